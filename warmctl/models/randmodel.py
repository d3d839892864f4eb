"""Random-weight Llamas of any size: engines of 8, 16 or more GiB with no model hub.

``builtin:random-llama-<layers>x<hidden>`` names a decoder of Llama-2's architecture
(``LlamaForCausalLM``: RMSNorm, rotary embeddings, SwiGLU MLP, multi-head attention) with
``layers`` decoder layers of width ``hidden``, stored in float32 (``...-bf16``: bfloat16); the other
dimensions follow Llama's rules: head size 128 (``hidden / 128`` attention heads, as many KV
heads), MLP width ``8/3 * hidden`` rounded up to a multiple of 256 (4096 -> 11008, Llama-2-7B's),
and the tiny model's tokenizer (:mod:`warmctl.models.tinymodel`, vocabulary
:data:`~warmctl.models.tinymodel.VOCAB_SIZE`). So ``random-llama-32x4096-bf16`` has Llama-2-7B's shape
(6.48 B parameters, 12.1 GiB) and ``random-llama-16x4096`` half its layers in float32 (3.25 B
parameters, the same 12.1 GiB).

The checkpoint's dtype is what the engine holds only when the profile says so: vLLM's
``--dtype auto`` downcasts a float32 checkpoint to bfloat16 ("Downcasting torch.float32 to
torch.bfloat16" in the engine log), so a float32 ``random-llama`` is served from half its file's
bytes unless the profile passes ``--dtype float32``. A bfloat16 engine computes on AMX tiles on
AMX hosts (``amx_bf16`` in /proc/cpuinfo, as here: oneDNN's ``brg_matmul:avx10_1_512_amx``),
and CRIU 4.2.1 alone restores such a process without its AMX permission: the worker dies with
SIGILL (exit -4) at its first request after ``up`` (seen here with ``random-llama-2x1024-bf16``;
a one-matmul Python process dumped and restored dies the same way, and lives with
``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``). warmctl's ``criu-xtile-perm.so``
(``warmctl/checkpoint/criu.py``) restores the permission.

The weights have random sign and mantissa and a bounded exponent (magnitudes 2**-8 to 2**-4,
std about 0.027; norms 1.0), drawn by ``torch.Generator`` seeded per tensor from :data:`SEED`
and the tensor's name, so the bytes depend only on the recipe (not on chunking, thread count or
tensor order) and the canary's tokens and logprobs repeat run to run. They are untrained: the
output is fluent noise, which is all a snapshot benchmark needs. The weights are streamed into
one ``model.safetensors`` (the header first, then each tensor generated and written in chunks
of :data:`CHUNK_ELEMS`), so building needs no more memory than one chunk (about 0.3 GiB/s on
one core here).

The model is cached by its recipe: its directory is ``random-llama-<layers>x<hidden>[-bf16]-<recipe
id>`` under the models directory (:func:`recipe_id`: shape, dtype, seed, recipe version and the
tokenizer's recipe), built once (atomically, a temp dir renamed into place) and reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from warmctl.models import tinymodel

#: ``builtin:random-llama-<layers>x<hidden>``.
NAME_RE = re.compile(r"builtin:random-llama-(?P<layers>[1-9][0-9]{0,3})x(?P<hidden>[1-9][0-9]{1,5})(?P<bf16>-bf16)?")
SEED = 20261201
HEAD_DIM = 128
#: Bump when anything below changes the bytes; part of :func:`recipe_id`.
RECIPE_VERSION = 2
#: Elements generated per step (64 Mi: 256 MiB of float32 scratch, 128 MiB written).
CHUNK_ELEMS = 1 << 26


@dataclass(frozen=True)
class Shape:
    """The dimensions of a ``random-llama`` model (see the module docstring for the rules)."""

    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    dtype: str = "float32"

    @property
    def bytes_per_param(self) -> int:
        return 2 if self.dtype == "bfloat16" else 4

    @classmethod
    def of(cls, layers: int, hidden: int, dtype: str = "float32") -> "Shape":
        """The shape for ``layers`` x ``hidden``. Raises ValueError if ``hidden`` is not a
        multiple of :data:`HEAD_DIM` or either is below 1."""
        if layers < 1 or hidden < HEAD_DIM or hidden % HEAD_DIM:
            raise ValueError(f"random-llama-{layers}x{hidden}: need layers >= 1 and hidden a multiple of {HEAD_DIM}")
        inter = -(-(8 * hidden // 3) // 256) * 256
        return cls(layers, hidden, hidden // HEAD_DIM, inter, tinymodel.VOCAB_SIZE, dtype)

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor, in file order (as ``LlamaForCausalLM`` names them)."""
        h, i, v = self.hidden, self.intermediate, self.vocab
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
            out += [(p + f"self_attn.{k}_proj.weight", (h, h)) for k in "qkvo"]
            out += [(p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                    (p + "mlp.down_proj.weight", (h, i))]
        return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]

    def params(self) -> int:
        """Parameter count."""
        total = 0
        for _, s in self.tensors():
            n = 1
            for d in s:
                n *= d
            total += n
        return total

    def weight_bytes(self) -> int:
        """Bytes of the weights (the safetensors file's data; the engine holds the same)."""
        return self.params() * self.bytes_per_param


def parse(model: str) -> Shape | None:
    """The :class:`Shape` a ``builtin:random-llama-<L>x<H>`` name asks for; None for other names.
    Raises ValueError for a malformed size (:meth:`Shape.of`)."""
    m = NAME_RE.fullmatch(model)
    return None if m is None else Shape.of(int(m["layers"]), int(m["hidden"]), "bfloat16" if m["bf16"] else "float32")


def recipe_id(shape: Shape) -> str:
    """Short digest of everything that determines the model's bytes."""
    h = hashlib.sha256(json.dumps({"v": RECIPE_VERSION, "seed": SEED, "draw": "bits-exp-2",
                                   "shape": asdict(shape), "tokenizer": tinymodel.recipe_id()}, sort_keys=True).encode())
    return h.hexdigest()[:12]


def model_dir(models_root: Path, shape: Shape) -> Path:
    """``<models_root>/random-llama-<layers>x<hidden>-<recipe id>``."""
    bf16 = "-bf16" if shape.dtype == "bfloat16" else ""
    return Path(models_root) / f"random-llama-{shape.layers}x{shape.hidden}{bf16}-{recipe_id(shape)}"


def _tensor_seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{SEED}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


# Random bits per 64-bit word, then each lane bounded: sign and mantissa kept, the exponent
# set to 2**-8 .. 2**-5 by two random bits (bfloat16: four 16-bit lanes; float32: two 32-bit lanes).
_LANES = {"bfloat16": (0x807F807F807F807F, 0x0003000300030003, 0x0077007700770077, 7),
          "float32": (0x807FFFFF807FFFFF, 0x0000000300000003, 0x0000007700000077, 23)}


def _words(buf, tmp, g, dtype: str):
    """Fill ``buf`` (int64) with random bits from ``g`` and bound each lane of ``dtype`` to a
    magnitude in [2**-8, 2**-4) (std about 0.027, never NaN, inf or subnormal). Returns ``buf``."""
    import torch

    keep, ebits, ebase, shift = _LANES[dtype]
    buf.random_(-(1 << 63), (1 << 63) - 1, generator=g)  # all 64 bits (random_() leaves the top one 0)
    torch.bitwise_right_shift(buf, shift, out=tmp)
    tmp.bitwise_and_(ebits).add_(ebase).bitwise_left_shift_(shift)
    return buf.bitwise_and_(keep - (1 << 64)).bitwise_or_(tmp)


def write_weights(path: Path, shape: Shape, chunk_elems: int = CHUNK_ELEMS) -> int:
    """Stream the weights of ``shape`` into the safetensors file ``path``; returns its size in
    bytes. Norm weights are 1.0, all others random from each tensor's own generator,
    generated ``chunk_elems`` elements at a time."""
    import torch

    header: dict = {"__metadata__": {"format": "pt", "warmctl_recipe": recipe_id(shape)}}
    off = 0
    specs = shape.tensors()
    for name, s in specs:
        n = shape.bytes_per_param
        for d in s:
            n *= d
        header[name] = {"dtype": "BF16" if shape.dtype == "bfloat16" else "F32", "shape": list(s), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    bpp = shape.bytes_per_param
    tdtype = torch.bfloat16 if shape.dtype == "bfloat16" else torch.float32
    words = -(-chunk_elems * bpp // 8)
    buf, tmp = torch.empty(words, dtype=torch.int64), torch.empty(words, dtype=torch.int64)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for name, s in specs:
            count = 1
            for d in s:
                count *= d
            if name.endswith("norm.weight"):
                f.write(torch.ones(count, dtype=tdtype).view(torch.uint8).numpy().tobytes())
                continue
            g = torch.Generator().manual_seed(_tensor_seed(name))
            done = 0
            while done < count:
                k = min(chunk_elems, count - done)
                w = -(-k * bpp // 8)
                f.write(memoryview(_words(buf[:w], tmp[:w], g, shape.dtype).view(torch.uint8).numpy())[: bpp * k])
                done += k
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def build(dest: Path, shape: Shape) -> Path:
    """Build the model of ``shape`` into ``dest`` (the tiny model's tokenizer, a Llama
    ``config.json``, ``model.safetensors``); returns ``dest``. Does nothing if
    ``dest/config.json`` exists. Raises ImportError without torch/transformers/tokenizers,
    OSError when the disk is full (nothing is left behind)."""
    dest = Path(dest)
    if (dest / "config.json").exists():
        return dest
    from transformers import LlamaConfig

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        tok = tinymodel.tokenizer()  # the tiny model's, without the tiny model's training
        tok.save_pretrained(tmp)
        LlamaConfig(
            vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
            num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.heads,
            max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.convert_tokens_to_ids("<|end|>"), pad_token_id=tok.pad_token_id,
            tie_word_embeddings=False, torch_dtype=shape.dtype,
        ).save_pretrained(tmp)
        write_weights(tmp / "model.safetensors", shape)
        os.replace(tmp, dest) if not dest.exists() else shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
