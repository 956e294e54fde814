"""The MTP draft layers as torch modules (trainable), in the standard form:

    u   = eh_proj · [enorm(embed(x_{j+k+1})) ; hnorm(h_j)]     embedding first
    u  += attn(input_layernorm(u))        causal over the draft rows, RoPE at row j
    u  += mlp(post_attention_layernorm(u))
    out = final_layernorm(u)              -> the shared, frozen lm_head

Geometry (heads, KV heads, head_dim, RoPE) is the backbone's; every layer starts
from a copy of one backbone block, ``hnorm`` scaled so the hidden passes through
``eh_proj = [0 | I]`` at its usual size, ``final_layernorm`` = the backbone's final
norm. Names match ``model.mtp.layers.{k}.*`` of a CMF sidecar (``tensors()``).

Only ``trainer`` imports this module: torch is the optional ``[train]`` extra.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from formats.arch import ArchConfig
from formats.errors import CortiqError


class RMSNorm(nn.Module):
    def __init__(self, scale: np.ndarray, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(np.asarray(scale, np.float32)))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _linear(w: np.ndarray, b: np.ndarray | None = None) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor(w))
        if b is not None:
            lin.bias.copy_(torch.tensor(b))
    return lin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int) -> torch.Tensor:
    """HF rotate_half RoPE over the first ``rd`` dims; x [B, heads, T, d]."""
    r, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    x1, x2 = r[..., :half], r[..., half:]
    c = torch.cat([cos, cos], -1)
    s = torch.cat([sin, sin], -1)
    rot = r * c + torch.cat([-x2, x1], -1) * s
    return torch.cat([rot, rest], -1) if rest.shape[-1] else rot


class TorchBlock(nn.Module):
    """One pre-norm llama-family block: u += attn(norm(u)); u += mlp(norm(u))."""

    def __init__(self, arch: ArchConfig, block: dict[str, np.ndarray], inter: int | None = None, seed: int = 0):
        super().__init__()
        self.nh, self.nkv, self.hd, self.vd = arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.v_head_dim
        self.rd = arch.rotary_dim
        eps = arch.norm_eps
        one = 1.0 if arch.norm_style == "rms_one" else 0.0  # effective scale = stored + one
        self.input_layernorm = RMSNorm(block["input_layernorm.weight"] + one, eps)
        self.post_attention_layernorm = RMSNorm(block["post_attention_layernorm.weight"] + one, eps)
        self.q_proj = _linear(block["self_attn.q_proj.weight"], block.get("self_attn.q_proj.bias"))
        self.k_proj = _linear(block["self_attn.k_proj.weight"], block.get("self_attn.k_proj.bias"))
        self.v_proj = _linear(block["self_attn.v_proj.weight"], block.get("self_attn.v_proj.bias"))
        self.o_proj = _linear(block["self_attn.o_proj.weight"], block.get("self_attn.o_proj.bias"))
        self.q_norm = self.k_norm = None
        if "self_attn.q_norm.weight" in block:
            self.q_norm = RMSNorm(block["self_attn.q_norm.weight"] + one, eps)
            self.k_norm = RMSNorm(block["self_attn.k_norm.weight"] + one, eps)
        gate, up, down = _resize_mlp(block, inter or block["mlp.gate_proj.weight"].shape[0], seed)
        self.gate_proj, self.up_proj, self.down_proj = _linear(gate), _linear(up), _linear(down)

    def forward(self, u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = u.shape
        x = self.input_layernorm(u)
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.vd).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = _rotate(q, cos[:t], sin[:t], self.rd)
        k = _rotate(k, cos[:t], sin[:t], self.rd)
        rep = self.nh // self.nkv
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        u = u + self.o_proj(a.transpose(1, 2).reshape(b, t, self.nh * self.vd))
        x = self.post_attention_layernorm(u)
        return u + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def attend(
        self, u: torch.Tensor, pos: torch.Tensor, q0: int, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The block over rows ``u`` [B, R, H] at RoPE positions ``pos`` [R] where only rows
        ``q0:`` are queries and ``mask`` [R - q0, R] (True = attend) says which rows each
        sees: the training-time test's view of a round's provisional rows. Returns the
        query rows' outputs [B, R - q0, H]."""
        b, r, _ = u.shape
        nq = r - q0
        x = self.input_layernorm(u)
        xq = x[:, q0:]
        q = self.q_proj(xq).view(b, nq, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, r, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, r, self.nkv, self.vd).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = _rotate(q, cos[pos[q0:]], sin[pos[q0:]], self.rd)
        k = _rotate(k, cos[pos], sin[pos], self.rd)
        rep = self.nh // self.nkv
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        uq = u[:, q0:] + self.o_proj(a.transpose(1, 2).reshape(b, nq, self.nh * self.vd))
        x = self.post_attention_layernorm(uq)
        return uq + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def named_arrays(self) -> dict[str, torch.Tensor]:
        out = {
            "input_layernorm.weight": self.input_layernorm.weight,
            "post_attention_layernorm.weight": self.post_attention_layernorm.weight,
            "self_attn.q_proj.weight": self.q_proj.weight,
            "self_attn.k_proj.weight": self.k_proj.weight,
            "self_attn.v_proj.weight": self.v_proj.weight,
            "self_attn.o_proj.weight": self.o_proj.weight,
            "mlp.gate_proj.weight": self.gate_proj.weight,
            "mlp.up_proj.weight": self.up_proj.weight,
            "mlp.down_proj.weight": self.down_proj.weight,
        }
        for x in "qkvo":
            lin = getattr(self, f"{x}_proj")
            if lin.bias is not None:
                out[f"self_attn.{x}_proj.bias"] = lin.bias
        if self.q_norm is not None:
            out["self_attn.q_norm.weight"] = self.q_norm.weight
            out["self_attn.k_norm.weight"] = self.k_norm.weight
        return out


class DraftLayer(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        block: dict[str, np.ndarray],
        inter: int,
        hnorm_scale: float,
        final_scale: np.ndarray,
        seed: int,
    ):
        super().__init__()
        h = arch.hidden_size
        eps = arch.norm_eps
        self.norm_offset = 1.0 if arch.norm_style == "rms_one" else 0.0
        self.enorm = RMSNorm(np.ones(h, np.float32), eps)
        self.hnorm = RMSNorm(np.full(h, hnorm_scale, np.float32), eps)
        eh = np.zeros((h, 2 * h), np.float32)
        eh[:, h:] = np.eye(h, dtype=np.float32)
        self.eh_proj = _linear(eh)
        self.block = TorchBlock(arch, block, inter, seed)
        self.final_layernorm = RMSNorm(final_scale, eps)

    def forward(self, emb: torch.Tensor, hid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """emb, hid [B, T, H] (row j: embed of x_{j+k+1}, backbone hidden h_j) -> final-normed [B, T, H]."""
        u = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hid)], -1))
        return self.final_layernorm(self.block(u, cos, sin))

    def pre_norm(self, emb: torch.Tensor, hid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Teacher-forced rows before ``final_layernorm`` (what the recursive chain feeds back)."""
        return self.block(self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hid)], -1)), cos, sin)

    def attend(
        self,
        emb: torch.Tensor,
        hid: torch.Tensor,
        pos: torch.Tensor,
        q0: int,
        mask: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Rows (emb, hid) [B, R, H] at positions ``pos``; queries ``q0:`` under ``mask``
        (``TorchBlock.attend``). Returns the query rows before ``final_layernorm``."""
        u = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hid)], -1))
        return self.block.attend(u, pos, q0, mask, cos, sin)

    def named_arrays(self) -> dict[str, torch.Tensor]:
        """The trainable tensors under their sidecar names (relative to ``model.mtp.layers.{k}.``)."""
        return {
            "enorm.weight": self.enorm.weight,
            "hnorm.weight": self.hnorm.weight,
            "eh_proj.weight": self.eh_proj.weight,
            "final_layernorm.weight": self.final_layernorm.weight,
            **self.block.named_arrays(),
        }

    def tensors(self) -> dict[str, np.ndarray]:
        """f32 copies for the sidecar (norms in the backbone's stored convention)."""
        arrays = {n: t.detach().cpu().numpy().astype(np.float32, copy=True) for n, t in self.named_arrays().items()}
        if self.norm_offset:
            for n, a in arrays.items():
                if n.endswith("norm.weight"):
                    a -= self.norm_offset
        return arrays


def _resize_mlp(block: dict[str, np.ndarray], inter: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The backbone MLP cut or widened to ``inter``; new units start with small
    gate/up rows and zero down columns, so the block's output is unchanged."""
    gate, up, down = block["mlp.gate_proj.weight"], block["mlp.up_proj.weight"], block["mlp.down_proj.weight"]
    have = gate.shape[0]
    if inter <= have:
        return gate[:inter].copy(), up[:inter].copy(), down[:, :inter].copy()
    rng = np.random.default_rng(seed)
    extra = inter - have
    std = float(gate.std()) or 0.02
    g = np.concatenate([gate, rng.normal(0, std, (extra, gate.shape[1])).astype(np.float32)])
    u = np.concatenate([up, rng.normal(0, std, (extra, up.shape[1])).astype(np.float32)])
    d = np.concatenate([down, np.zeros((down.shape[0], extra), np.float32)], axis=1)
    return g, u, d


class DraftStack(nn.Module):
    """K independent layers (MiMo form): layer k drafts depth k+1 from the backbone hidden."""

    def __init__(self, layers: list[DraftLayer], cos: torch.Tensor, sin: torch.Tensor):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def layer_out(self, k: int, emb: torch.Tensor, hid: torch.Tensor) -> torch.Tensor:
        return self.layers[k](emb, hid, self.cos, self.sin)

    def tensors(self) -> dict[str, np.ndarray]:
        out = {}
        for k, layer in enumerate(self.layers):
            out.update({f"model.mtp.layers.{k}.{n}": a for n, a in layer.tensors().items()})
        return out


# The tensors of a llama-style block, the one these draft layers copy and re-implement.
LLAMA_BLOCK = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def require_llama_blocks(backbone, layers: list[int], hint: str) -> None:
    """Refuse, in one line, a backbone whose ``layers`` are not llama-style blocks: the
    draft layers start from one (and the torch backbone re-implements them all), and
    the sidecar they make is loaded by the backbone's family as its own draft blocks."""
    from cortiq_engine.models import FAMILIES

    arch = backbone.arch
    if arch.mla is not None:
        raise CortiqError(
            f"mtp-train makes llama-style draft layers (q/k/v/o attention, a gated MLP); this {arch.arch} model's layers "
            "use multi-head latent attention, which they can neither start from nor be loaded as (use its own MTP layers)"
        )
    manifest = FAMILIES.for_arch(arch.arch).manifest(arch, ())
    for i in layers:
        missing = [n for n in LLAMA_BLOCK if f"model.layers.{i}.{n}" not in manifest.names()]
        if missing:
            raise CortiqError(
                f"mtp-train makes llama-style draft layers (q/k/v/o attention, a gated MLP); layer {i} of this "
                f"{arch.arch} model has no {missing[0]} ({hint})"
            )


def build_stack(
    backbone, k: int, inter: int | None, init_layer: int, hnorm_scale: float, seq: int, seed: int
) -> DraftStack:
    arch = backbone.arch
    require_llama_blocks(backbone, [init_layer % arch.num_layers], "choose another --init-layer")
    block = backbone.block_f32(init_layer % arch.num_layers)
    width = inter or block["mlp.gate_proj.weight"].shape[0]
    final = backbone.final_norm_weight()
    layers = [DraftLayer(arch, block, width, hnorm_scale, final, seed + i) for i in range(k)]
    # Recursive drafts sit up to K positions past the last row.
    return DraftStack(layers, *rope_tables(arch, seq + k + 1))


def rope_tables(arch: ArchConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    from cortiq_engine.layers import RoPE

    inv = RoPE(arch.rotary_dim, arch.rope_theta, arch.rope_scaling).inv_freq
    ang = torch.arange(max_len, dtype=torch.float32)[:, None] * torch.tensor(inv, dtype=torch.float32)[None, :]
    return torch.cos(ang), torch.sin(ang)


class TorchBackbone:
    """The frozen backbone in torch (its stored weights dequantized to f32): the fast
    way to collect hidden rows on a CPU where the engine's prefill is the slower one."""

    def __init__(self, backbone, max_len: int):
        arch = backbone.arch
        require_llama_blocks(backbone, list(range(arch.num_layers)), "use --backbone engine")
        self.blocks = [TorchBlock(arch, backbone.block_f32(i)).requires_grad_(False) for i in range(arch.num_layers)]
        self.cos, self.sin = rope_tables(arch, max_len)
        self.backbone = backbone
        self.norm_w = torch.tensor(backbone.final_norm_weight())
        self.eps = arch.norm_eps
        self.head = torch.tensor(backbone.head_f32())
        self.hidden_size = arch.hidden_size
        self.vocab_size = int(self.head.shape[0])

    @torch.no_grad()
    def hidden(self, ids: np.ndarray) -> np.ndarray:
        """Pre-final-norm hidden rows [T, H] of one fresh sequence."""
        u = torch.from_numpy(self.backbone.embed_f32(ids))[None]
        for b in self.blocks:
            u = b(u, self.cos, self.sin)
        return u[0].numpy()

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(x, np.float32))
        return (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_w).numpy()

    @torch.no_grad()
    def logits(self, normed: np.ndarray) -> np.ndarray:
        return (torch.from_numpy(np.ascontiguousarray(normed, np.float32)) @ self.head.T).numpy()


def depth_outputs(
    stack: DraftStack, embed, tokens: np.ndarray, hid: torch.Tensor, depth: int, chain: str, ttt: bool, pick
) -> list[torch.Tensor]:
    """Final-normed draft rows of every depth over windows ``tokens`` [B, T] with backbone
    hidden ``hid`` [B, T, H]; depth d's row j is the round after position j (it drafts the
    token j+d+1, 0-based d). ``embed(ids [B, n]) -> [B, n, H]``; ``pick(d, rows) -> ids
    [B, n]`` is depth d's draft (argmax), which the later depths read.

    With ``ttt`` (the training-time test) each depth sees what ``cortiq_engine.mtp.Drafter``
    feeds it at inference: the round's earlier drafts where the text is not known yet.
    ``independent``: layer d's row t reads (embed(x_{t+d+1}), h_t) and its provisional rows
    t-i (i < d) read this round's draft of depth d-i, the rows <= t-d the true tokens; so
    each query row attends true rows r <= j-d and one row of each draft copy. ``recursive``:
    layer 0 only; depth d's row j sits at position j+d, reads the draft of depth d and the
    pre-norm output of depth d-1 at row j, and attends true rows <= j plus row j of every
    earlier depth. Without ``ttt`` the true tokens stand in for the drafts (teacher forcing).
    """
    t = tokens.shape[1]
    cos, sin = stack.cos, stack.sin
    outs: list[torch.Tensor] = []
    drafts: list[np.ndarray] = []  # [B, T-d-1]: depth d's draft in the round after row j
    pre: list[torch.Tensor] = []  # recursive: each depth's pre-norm rows
    for d in range(depth):
        n = t - d - 1
        layer = stack.layers[d if chain == "independent" else 0]
        if d == 0 or (chain == "independent" and not ttt):
            u = layer.pre_norm(embed(tokens[:, d + 1 : t]), hid[:, :n], cos, sin)
        elif chain == "independent":
            # Copies m = 1..d: row j reads the draft of depth m for position j+d+1 (made in the
            # round after j-d+m), or the true token when not ttt; copy 0 is the true text.
            toks = [tokens[:, d + 1 : t]]
            for m in range(1, d + 1):
                toks.append(drafts[m - 1][:, d - m : d - m + n] if ttt else tokens[:, d + 1 : t])
            emb = embed(np.concatenate(toks, axis=1))
            hh = hid[:, :n].repeat(1, d + 1, 1)
            pos = torch.arange(n).repeat(d + 1)
            j = torch.arange(n)[:, None]
            r = torch.arange(n)[None, :]
            mask = torch.cat([r <= j - d] + [r == j - d + m for m in range(1, d + 1)], dim=1)
            u = layer.attend(emb, hh, pos, d * n, mask, cos, sin)
        else:
            toks = [tokens[:, 1 : 1 + n]]
            hs = [hid[:, :n]]
            ps = [torch.arange(n)]
            for m in range(1, d + 1):
                toks.append(drafts[m - 1][:, :n] if ttt else tokens[:, m + 1 : m + 1 + n])
                hs.append(pre[m - 1][:, :n])
                ps.append(torch.arange(n) + m)
            j = torch.arange(n)[:, None]
            r = torch.arange(n)[None, :]
            mask = torch.cat([r <= j] + [r == j] * d, dim=1)
            u = layer.attend(
                embed(np.concatenate(toks, axis=1)), torch.cat(hs, 1), torch.cat(ps), d * n, mask, cos, sin
            )
        pre.append(u)
        y = layer.final_layernorm(u)
        outs.append(y)
        if d + 1 < depth:
            drafts.append(pick(d, y))
    return outs
