"""Differentiable unrolled draft steps ("training-time test", EAGLE-3) over packed rows.

The serving head attends through the paged cache; training needs gradients and a mask no cache
expresses: step k's query at base position t sees the step-0 keys at positions <= t of its own
sequence, plus the keys of steps 1..k at base t only (its own draft ancestors). That is exactly
what the drafter shows a depth-k node (keys of committed positions, then its ancestors), and the
rope position of step k at base t is t + k, as in `drafter._level`.

Step k at base t takes the token at t+1+k (teacher forcing: the data's tokens, which are the
target's own for self-distilled text) and step k-1's output (the fused target features at k=0),
and predicts the target's distribution at t+1+k. EAGLE-1 is the same loop with its fc over
[embedding | feature] at every step and the feature regression target at t+1+k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle_worker.speculative.heads import DraftHead


@dataclass
class Rows:
    """B packed rows of length L; several whole sequences per row, -1 seq id on padding."""

    features: torch.Tensor    # [B, L, F]
    tokens: torch.Tensor      # [B, L] long
    seq_id: torch.Tensor      # [B, L] long
    positions: torch.Tensor   # [B, L] long, position within its sequence
    topk_ids: torch.Tensor    # [B, L, K] long, target ids
    topk_logp: torch.Tensor   # [B, L, K] float
    label_mask: torch.Tensor  # [B, L] bool: the prediction at this position is trained

    def to(self, device: torch.device) -> Rows:
        return Rows(*(getattr(self, f).to(device, non_blocking=True) for f in self.__dataclass_fields__))


def _shift(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """y[:, t] = x[:, t + n], `fill` past the end."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], 1)


def _attention(head: DraftHead, x: torch.Tensor, pos: torch.Tensor, keys: list, values: list,
               mask0: torch.Tensor) -> torch.Tensor:
    """q/k/v of this step from `x` [B, L, in]; attend to step-0 keys (mask0) and the diagonal of
    later steps. Appends this step's k/v to `keys`/`values`."""
    attn = head.layers[0].self_attn if head.kind == "eagle" else head.midlayer.self_attn
    B, L, _ = x.shape
    nh, nkv, hd = attn.qkv_proj.num_heads, attn.qkv_proj.num_kv_heads, attn.attn.head_dim
    q, k, v = attn.qkv_proj.split(attn.qkv_proj(x.reshape(B * L, -1)))
    q, k = attn.rotary_emb(pos.reshape(-1), q, k)
    q = q.view(B, L, nh, hd).transpose(1, 2)
    k = k.view(B, L, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
    v = v.view(B, L, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
    keys.append(k)
    values.append(v)
    scale = hd ** -0.5
    s0 = (q @ keys[0].transpose(-1, -2)) * scale
    s0 = s0.float().masked_fill(~mask0, float("-inf"))
    diag = [((q * kj).sum(-1) * scale).float()[..., None] for kj in keys[1:]]
    p = torch.softmax(torch.cat([s0, *diag], -1), -1).to(v.dtype)
    out = p[..., :L] @ values[0]
    for j, vj in enumerate(values[1:]):
        out = out + p[..., L + j, None] * vj
    return attn.o_proj(out.transpose(1, 2).reshape(B, L, nh * hd))


def _eagle3_step(head, h, emb, pos, keys, values, mask0):
    mid = head.midlayer
    hn = mid.hidden_norm(h)
    residual = hn if mid.norm_before_residual else h
    x = torch.cat([mid.input_layernorm(emb), hn], -1)
    h = residual + _attention(head, x, pos, keys, values, mask0)
    return h + mid.mlp(mid.post_attention_layernorm(h))


def _eagle1_step(head, feat, emb, pos, keys, values, mask0):
    layer = head.layers[0]
    h = head.fc(torch.cat([emb, feat], -1))
    h = h + _attention(head, h, pos, keys, values, mask0)
    return h + layer.mlp(layer.post_attention_layernorm(h))


@dataclass
class StepOut:
    loss: torch.Tensor        # scalar: CE (+ regression for EAGLE-1) over valid positions
    correct: torch.Tensor     # [B, L] bool: draft argmax == target argmax (False where invalid)
    valid: torch.Tensor       # [B, L] bool
    follows: torch.Tensor     # [B, L] bool: the next input token is the target's argmax here


def unrolled_forward(head: DraftHead, rows: Rows, steps: int, target_to_draft: torch.Tensor,
                     feature_noise: float = 0.0, reg_weight: float = 1.0, ce_weight: float = 0.1) -> list[StepOut]:
    """Run `steps` draft steps; per step the loss over the draft vocabulary (EAGLE-3) or the
    target's (EAGLE-1) against the target's top-k distribution renormalised to that vocabulary.
    `target_to_draft[V]` maps target ids to draft rows (-1 outside)."""
    B, L = rows.tokens.shape
    ar = torch.arange(L, device=rows.tokens.device)
    same = rows.seq_id[:, :, None] == rows.seq_id[:, None, :]
    mask0 = (same & (ar[None, :, None] >= ar[None, None, :]))[:, None]    # [B, 1, L, L]
    eye = torch.eye(L, dtype=torch.bool, device=mask0.device)
    mask0 = mask0 | eye                                                     # padding rows stay finite
    feats = rows.features.float()     # autocast (when on) runs the matmuls in bf16
    if feature_noise:                 # EAGLE-1's robustness trick: uniform noise on the input features
        feats = feats + (torch.rand_like(feats) - 0.5) * 2 * feature_noise
    eagle3 = head.kind == "eagle3"
    h = head.fc(feats) if eagle3 else feats
    keys, values, outs = [], [], []
    for k in range(steps):
        tok = _shift(rows.tokens, 1 + k, 0)
        emb = head.embed(tok).float()
        pos = rows.positions + k
        if eagle3:
            h = _eagle3_step(head, h, emb, pos, keys, values, mask0)
        else:
            h = _eagle1_step(head, h, emb, pos, keys, values, mask0)
        valid = (rows.seq_id >= 0) & (_shift(rows.seq_id, 1 + k, -2) == rows.seq_id) & _shift(rows.label_mask, 1 + k, False)
        t_ids = _shift(rows.topk_ids, 1 + k, 0)
        t_lp = _shift(rows.topk_logp, 1 + k, float("-inf"))
        d_ids = target_to_draft[t_ids]                                   # [B, L, K]
        valid = valid & (d_ids[..., 0] >= 0)                             # target argmax must be draftable
        follows = _shift(rows.tokens, 2 + k, -1) == t_ids[..., 0]
        idx = valid.nonzero(as_tuple=True)
        hv = h[idx]
        if eagle3:
            logits = head.logits(hv).float()
        else:   # the target's own LM head (frozen, maybe bf16)
            logits = head.target.compute_logits(hv.to(head.target.lm_head.weight.dtype)).float()
        logp = torch.log_softmax(logits, -1)
        dv, lpv = d_ids[idx], t_lp[idx].float()
        lpv = lpv.masked_fill(dv < 0, float("-inf"))
        p = torch.softmax(lpv, -1)                                       # renormalised over the draft vocabulary
        col = dv.clamp(min=0) if eagle3 else t_ids[idx]
        loss = -(p * logp.gather(1, col)).sum(-1).mean() if len(dv) else h.sum() * 0
        if eagle3:
            pred = logp.argmax(-1) == col[:, 0]
        else:
            pred = logp.argmax(-1) == t_ids[idx][:, 0]
            tgt = _shift(rows.features, 1 + k, 0)[idx].float()
            loss = ce_weight * loss + reg_weight * F.smooth_l1_loss(hv.float(), tgt) if len(dv) else loss
        correct = torch.zeros_like(valid)
        correct[idx] = pred
        outs.append(StepOut(loss, correct, valid, follows))
    return outs


def chain_accepted(outs: list[StepOut]) -> torch.Tensor:
    """Per base position, how many chain drafts a greedy verifier would accept (0..steps)."""
    alive = torch.ones_like(outs[0].valid)
    total = torch.zeros(outs[0].valid.shape, dtype=torch.long, device=alive.device)
    for k, o in enumerate(outs):
        alive = alive & o.correct
        total += alive.long()
        alive = alive & o.follows
    return total
