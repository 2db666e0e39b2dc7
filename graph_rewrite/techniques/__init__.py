"""Techniques the rewriter can apply (one module each: settings dataclass, CLI flags, composition
checks). Only the attention technique lives here so far; KWTA is still in ``config.py`` until the
technique registry lands."""
