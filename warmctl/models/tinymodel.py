"""The ``tiny`` model: a small Llama made locally, so the whole pipeline runs with no model hub.

Shape (see ``docs/design.md``, "The tiny model"): 2 layers, hidden size 128, 4 attention heads / 2 KV heads,
vocabulary 1024, weights initialised from a fixed seed, and a byte-level BPE tokenizer trained on
``warmctl/data/corpus.txt`` with a simple chat template. The weights are then trained for
:data:`TRAIN_STEPS` full-batch steps (AdamW, one thread) on that corpus plus a few chat turns, so
the model answers "What is the capital of France? One word." with "Paris." instead of noise:
a demo whose output a person can check by eye. Training on one thread with a fixed seed is
deterministic on a given machine; the model is built once per data directory and reused.

Building needs ``torch``, ``transformers`` and ``tokenizers`` (installed with the engine); it
takes 10-30 s on 2 cores and about 2 MB of disk.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "data" / "corpus.txt"
SEED = 20261129
VOCAB_SIZE = 1024
#: Bump when the recipe below changes; it is part of the model's directory name.
RECIPE_VERSION = 2
TRAIN_STEPS = 80
#: Chat turns learnt verbatim (question, answer).
CHAT_TURNS = [
    ("What is the capital of France? One word.", "Paris."),
    ("What is two plus two?", "Four."),
    ("Name three fruits.", "Apples, pears and plums."),
    ("Hello!", "Hello! How can I help you today?"),
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def recipe_id() -> str:
    """Short digest of everything that determines the model's bytes (recipe, seed, corpus)."""
    h = hashlib.sha256(f"{RECIPE_VERSION}:{SEED}:{VOCAB_SIZE}".encode())
    h.update(CORPUS.read_bytes())
    return h.hexdigest()[:12]


#: The models warmctl builds itself: ``builtin:NAME`` -> the kind :func:`build` makes.
BUILTIN = {"builtin:tiny": "llama", "builtin:tiny-moe": "moe"}
#: The mixture-of-experts variant: experts per layer and experts each token is routed to.
MOE_EXPERTS, MOE_TOP_K = 4, 2


def model_dir(models_root: Path, kind: str = "llama") -> Path:
    """Where the tiny model lives under ``models_root``: ``tiny-llama-<recipe id>`` (``kind``
    ``"moe"``: ``tiny-moe-<recipe id>``)."""
    return Path(models_root) / f"tiny-{kind}-{recipe_id()}"


def tokenizer():
    """The tiny model's tokenizer (a ``transformers.PreTrainedTokenizerFast``): byte-level BPE,
    :data:`VOCAB_SIZE` entries, trained on :data:`CORPUS` with :data:`SPECIAL_TOKENS` and
    :data:`CHAT_TEMPLATE`; deterministic, well under a second. Shared by the tiny models and the
    random-weight models (:mod:`warmctl.models.randmodel`), which need it without the tiny
    model's training. Raises ImportError without ``tokenizers``/``transformers``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.read_text().splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(dest: Path, kind: str = "llama") -> Path:
    """Build the tiny model into ``dest`` (atomically: a temp dir renamed into place).

    ``kind``: ``"llama"`` (the ``tiny`` Llama) or ``"moe"`` (the same tokenizer and attention
    in a Mixtral: :data:`MOE_EXPERTS` experts per layer, top-:data:`MOE_TOP_K` routing, for
    expert-parallel engines). Returns ``dest``. Does nothing if ``dest/config.json`` already
    exists. Raises ImportError if torch/transformers/tokenizers are not installed.
    """
    dest = Path(dest)
    if (dest / "config.json").exists():
        return dest
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        fast = tokenizer()
        fast.save_pretrained(tmp)

        torch.manual_seed(SEED)
        cls, cfg_cls, extra = LlamaForCausalLM, LlamaConfig, {}
        if kind == "moe":
            cls, cfg_cls = MixtralForCausalLM, MixtralConfig
            extra = {"num_local_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K}
        config = cfg_cls(
            **extra,
            vocab_size=VOCAB_SIZE,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            bos_token_id=fast.bos_token_id,
            eos_token_id=fast.convert_tokens_to_ids("<|end|>"),
            pad_token_id=fast.pad_token_id,
            tie_word_embeddings=False,
            torch_dtype="float32",
        )
        model = cls(config)
        _train(model, fast)
        model.save_pretrained(tmp, safe_serialization=True)
        os.replace(tmp, dest) if not dest.exists() else shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _train(model, tok) -> float:
    """Full-batch training on the corpus lines and :data:`CHAT_TURNS`; returns the final loss."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        end = tok.convert_tokens_to_ids("<|end|>")
        docs = [ln for ln in CORPUS.read_text().splitlines() if ln.strip()]
        docs += [tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                         tokenize=False) for q, a in CHAT_TURNS] * 4
        ids = [tok(d)["input_ids"] + [end] for d in docs]
        width = max(map(len, ids))
        batch = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])
        labels = batch.clone()
        labels[batch == tok.pad_token_id] = -100
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model.train()
        for _ in range(TRAIN_STEPS):
            loss = model(input_ids=batch, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        return float(loss.detach())
    finally:
        torch.set_num_threads(threads)


def main() -> None:  # pragma: no cover - thin script entry
    import sys

    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd()
    print(build(model_dir(root)))


if __name__ == "__main__":  # pragma: no cover
    main()
