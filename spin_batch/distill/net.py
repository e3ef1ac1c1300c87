"""The trainable draft: a small Llama decoder on the target's frozen embeddings, with a subset head.

DraftNet is the training-time form (autograd, whole sequences, causal SDPA). save_draft writes
it in the format of models/distilled.py, which loads into the inference LlamaModel; the two compute
the same function (tests/test_distill.py checks the logits agree).
"""

from __future__ import annotations

import json
import re
import shutil
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..models.distilled import DRAFT_KEY
from ..models.llama import rope_inv_freq
from ..models.spec import ModelSpec

HEAD_DIM = 64


@dataclass(frozen=True)
class DraftArch:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int | None = None  # target ids in the head; None: the distill default

    @property
    def name(self) -> str:
        return f"d{self.layers}x{self.hidden}" + (f"-k{self.vocab}" if self.vocab else "")

    @classmethod
    def parse(cls, text: str) -> "DraftArch":
        """'LxW[:K]' (layers x width, optionally the head's vocabulary size), e.g. '2x384' or '1x192:2048'.

        Heads of 64, about 3 query heads per KV head, MLP 8/3 W.
        """
        m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
        if not m:
            raise ValueError(f"draft size {text!r} is not LAYERSxWIDTH[:VOCAB], e.g. 2x384 or 1x192:2048")
        layers, width = int(m.group(1)), int(m.group(2))
        vocab = int(m.group(3)) if m.group(3) else None
        if vocab is not None and vocab < 2:
            raise ValueError(f"draft size {text!r}: the head needs at least 2 ids")
        if not 1 <= layers <= 32:
            raise ValueError(f"draft size {text!r}: layers must be 1..32")
        if width % HEAD_DIM or not HEAD_DIM <= width <= 4096:
            raise ValueError(f"draft size {text!r}: width must be a multiple of {HEAD_DIM} in {HEAD_DIM}..4096")
        heads = width // HEAD_DIM
        kv = max(d for d in range(1, heads + 1) if heads % d == 0 and d <= max(1, heads // 3))
        inter = -(-width * 8 // 3 // 64) * 64
        return cls(layers, width, heads, kv, inter, vocab)


def parse_sizes(text: str) -> list[DraftArch]:
    archs = [DraftArch.parse(part) for part in text.split(",") if part.strip()]
    if not archs:
        raise ValueError("no draft sizes given")
    # Two sizes that differ only in vocabulary get distinct names; the same name twice is a repeat.
    if len({a.name for a in archs}) != len(archs):
        raise ValueError(f"draft sizes repeat: {text}")
    return archs


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, w.shape, w, eps)


class _Layer(nn.Module):
    def __init__(self, a: DraftArch):
        super().__init__()
        C, H, KV, D, I = a.hidden, a.heads, a.kv_heads, HEAD_DIM, a.intermediate
        self.H, self.KV = H, KV
        self.input_layernorm = nn.Parameter(torch.ones(C))
        self.q_proj = nn.Linear(C, H * D, bias=False)
        self.k_proj = nn.Linear(C, KV * D, bias=False)
        self.v_proj = nn.Linear(C, KV * D, bias=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(C))
        self.gate_proj = nn.Linear(C, I, bias=False)
        self.up_proj = nn.Linear(C, I, bias=False)
        self.down_proj = nn.Linear(I, C, bias=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                past: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """h [B, T, C] -> (h, (k, v) of every row).

        past: the (k, v) of a first pass over the same rows. Row r then attends to the first pass's
        rows < r and to its own row only (see DraftNet.second_step).
        """
        B, T, _ = h.shape
        x = _rms(h, self.input_layernorm, eps)
        q = self.q_proj(x).view(B, T, self.H, HEAD_DIM).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(B, T, self.KV, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.KV, HEAD_DIM).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if past is None:
            keys, values, mask = k, v, None
        else:
            keys, values = torch.cat((past[0], k), 2), torch.cat((past[1], v.to(past[1].dtype)), 2)
            q, keys = q.to(values.dtype), keys.to(values.dtype)
            eye = torch.eye(T, dtype=torch.bool, device=h.device)
            mask = torch.cat((torch.ones(T, T, dtype=torch.bool, device=h.device).tril(-1), eye), 1)  # [T, 2T]
        # on CPU the math kernel trains 1.3-2x faster than flash at these shapes
        with sdpa_kernel(SDPBackend.MATH) if h.device.type == "cpu" else nullcontext():
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=True)  # [B, H, T, D]
        h = h + self.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        x = _rms(h, self.post_attention_layernorm, eps)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), (k, v)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DraftNet(nn.Module):
    """tokens [B, T] (and, for a feature-reading draft, the target's normalised features [B, T, E]
    paired with them) -> logits [B, T, K] over the kept ids, and the predicted features [B, T, E]."""

    def __init__(self, arch: DraftArch, target_embed: torch.Tensor, target_norm: torch.Tensor,
                 vocab_ids: torch.Tensor, rope_theta: float, rms_norm_eps: float = 1e-5,
                 reads_features: bool = False):
        super().__init__()
        self.arch = arch
        self.rope_theta = rope_theta
        self.eps = rms_norm_eps
        self.reads_features = reads_features
        E = target_embed.shape[1]
        self.register_buffer("embed", target_embed.detach().float(), persistent=False)  # frozen [V, E]
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=False)  # [K]
        # The target's head over the kept ids, its final norm weight folded in (frozen) [K, E].
        self.register_buffer("head_e", self.embed[self.vocab_ids] * target_norm.detach().float(), persistent=False)
        self.embed_proj = nn.Linear(2 * E if reads_features else E, arch.hidden, bias=False)
        self.layers = nn.ModuleList(_Layer(arch) for _ in range(arch.layers))
        self.norm = nn.Parameter(torch.ones(arch.hidden))
        self.lm_head_proj = nn.Linear(arch.hidden, E, bias=False)  # weight [E, C]: to the target's feature space
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        # Residual branch outputs start small (GPT-2 style), so depth does not blow up the stream.
        for layer in self.layers:
            for lin in (layer.o_proj, layer.down_proj):
                nn.init.normal_(lin.weight, std=0.02 / (2 * arch.layers) ** 0.5)
        self._inv_freq = rope_inv_freq(self.spec())

    def spec(self) -> ModelSpec:
        return ModelSpec.from_hf_config(self.hf_config())

    def hf_config(self) -> dict:
        a = self.arch
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": int(self.embed.shape[0]),
            "hidden_size": a.hidden,
            "intermediate_size": a.intermediate,
            "num_hidden_layers": a.layers,
            "num_attention_heads": a.heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": HEAD_DIM,
            "hidden_act": "silu",
            "rms_norm_eps": self.eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": False,
        }

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, g, _ = self.run(tokens, feats)
        return logits, g

    def run(self, tokens: torch.Tensor, feats: torch.Tensor | None = None,
            past: list[tuple[torch.Tensor, torch.Tensor]] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None, list[tuple[torch.Tensor, torch.Tensor]]]:
        """-> logits, predicted features, and each layer's (k, v) (a second_step needs them)."""
        T = tokens.shape[1]
        freqs = torch.arange(T, dtype=torch.float32, device=tokens.device)[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()  # [T, D], broadcast over [B, H, T, D]
        x = self.embed[tokens]
        if self.reads_features:
            x = torch.cat((x, feats), dim=-1)
        h = self.embed_proj(x).float()  # the residual stream stays float32 under autocast
        kvs = []
        for i, layer in enumerate(self.layers):
            h, kv = layer(h, cos, sin, self.eps, None if past is None else past[i])
            kvs.append(kv)
        h = _rms(h, self.norm, self.eps)
        if not self.reads_features:  # one [K, C] matmul, as at inference
            return (h @ (self.head_e @ self.lm_head_proj.weight).T).float(), None, kvs
        g = self.lm_head_proj(h).float()
        # logits = g @ head_e.T, folded: h @ (head_e @ proj).T costs C instead of E per kept id, and
        # the [K, C] product is shared by every row of the batch.
        return h @ (self.head_e @ self.lm_head_proj.weight).T, g, kvs

    def second_step(self, tokens: torch.Tensor, feats: torch.Tensor,
                    past: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row r as the draft's second token in a chain: it reads token r with feats[r] (the
        draft's own predicted feature of row r - 1) and attends to rows < r as a first pass `past`
        (tokens with the target's features) left them, and to itself.

        That is the draft's cache at inference: committed tokens are fed with the target's
        features, and only the token being drafted carries a predicted one.
        """
        logits, g, _ = self.run(tokens, feats, past)
        return logits, g

    def round_to(self, dtype: torch.dtype) -> None:
        """Round the weights to dtype in place (kept in float32): what is saved is what was measured."""
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(p.to(dtype).float())

    def saved_params(self) -> dict[str, nn.Parameter]:
        """The parameters under their safetensors names (Hugging Face Llama naming where one exists)."""
        sd: dict[str, nn.Parameter] = {
            "model.embed_proj.weight": self.embed_proj.weight,
            "model.norm.weight": self.norm,
            "lm_head_proj.weight": self.lm_head_proj.weight,
        }
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            sd[p + "input_layernorm.weight"] = layer.input_layernorm
            sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm
            for n in ("q", "k", "v", "o"):
                sd[p + f"self_attn.{n}_proj.weight"] = getattr(layer, f"{n}_proj").weight
            for n in ("gate", "up", "down"):
                sd[p + f"mlp.{n}_proj.weight"] = getattr(layer, f"{n}_proj").weight
        return sd

    def state_for_save(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out = {k: v.detach().to(dtype).contiguous() for k, v in self.saved_params().items()}
        out["vocab_ids"] = self.vocab_ids.to(torch.int64).contiguous()
        return out

    @classmethod
    def from_saved(cls, draft_dir: Path, target_embed: torch.Tensor, target_norm: torch.Tensor) -> "DraftNet":
        """The training form of a saved draft (to evaluate it, or to train it further)."""
        from safetensors.torch import load_file

        cfg = json.loads((Path(draft_dir) / "config.json").read_text())
        sd = load_file(str(Path(draft_dir) / "model.safetensors"))
        meta = cfg[DRAFT_KEY]
        net = cls(DraftArch(**meta["arch"]), target_embed, target_norm, sd.pop("vocab_ids"), cfg["rope_theta"],
                  cfg["rms_norm_eps"], bool(meta.get("reads_target_features")))
        params = net.saved_params()
        if params.keys() != sd.keys():
            raise ValueError(f"{draft_dir}: tensors do not match the draft architecture in config.json")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(sd[name].float())
        return net.eval()


def save_draft(net: DraftNet, out: Path, target_dir: Path, fingerprint: str, info: dict,
               dtype: torch.dtype = torch.bfloat16) -> None:
    """Write an HF-style draft directory (config.json, model.safetensors, tokenizer files)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = net.hf_config()
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    cfg[DRAFT_KEY] = {
        "format": 1,
        "target_fingerprint": fingerprint,
        "target_hidden_size": int(net.embed.shape[1]),
        "vocab_subset": int(net.vocab_ids.shape[0]),
        "reads_target_features": net.reads_features,
        "arch": asdict(net.arch),
        **info,
    }
    save_file(net.state_for_save(dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in Path(target_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens_map", "generation_config", "vocab", "merges")) \
                or f.name in ("chat_template.jinja",):
            shutil.copy2(f, out / f.name)
