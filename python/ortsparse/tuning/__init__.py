"""``ortsparse tune``, the product's main job: from a model and the user's text to a tuned model,
measured as written (:func:`.tune.tune`; the command line in :mod:`.command`)."""
