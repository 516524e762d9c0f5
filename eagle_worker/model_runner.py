"""Loads the target model, owns its paged KV cache and runs batched forward passes over it."""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig

from eagle_worker import default_models
from eagle_worker.attention import SeqAttention, attention_context, build_context
from eagle_worker.config import EngineConfig
from eagle_worker.layers import gemm_paths
from eagle_worker.loader import load_weights, resolve_model_path
from eagle_worker.logit_rows import LogitRows
from eagle_worker.malloc_tuning import keep_large_allocations
from eagle_worker.models.registry import model_class_for
from eagle_worker.outputs import TokenLogprob
from eagle_worker.parallel import all_gather_rows, broadcast_from_rank0, tp_rank, tp_size
from eagle_worker.sampler import token_logprobs
from eagle_worker.tokenizer_loader import load_tokenizer

SCORE_BLOCK_ROWS = 64    # prompt rows whose full-vocabulary logits exist at once (prompt_logprobs)


@dataclass
class ForwardItem:
    """One sequence's share of a forward: new tokens after `len(ctx_slots)` committed ones."""

    token_ids: list[int]
    positions: torch.Tensor          # [n] rope positions of the new tokens
    new_slots: torch.Tensor          # [n] cache slots the new tokens' K/V go to
    ctx_slots: torch.Tensor          # [ctx] cache slots of committed context (positions 0..ctx-1)
    logit_rows: list[int]            # offsets (within the new tokens) whose logits are wanted
    new_token_mask: torch.Tensor | None = None   # [n, n] visibility among new tokens; None = causal
    score_tokens: list[int] | None = None        # prompt_logprobs: the tokens new rows 0.. predict
    score_top: int = 0                           # ... and how many alternatives each keeps
    full_logits: bool = True                     # its logit rows' full logits are computed with the
                                                 # forward (False: only if asked, see logit_rows.py)


@dataclass
class ForwardResult:
    rows: LogitRows | None           # the LM head over the logit rows (sum(len(logit_rows)), in item
                                     # order); None when only argmax was asked
    hidden: torch.Tensor             # [T, H] final-norm output of every new token
    aux_hidden: list[torch.Tensor]   # inputs of the requested layers, [T, H] each
    row_offsets: list[int]           # start of each item's tokens in the flat batch
    argmax: torch.Tensor | None = None   # [sum(len(logit_rows))] greedy tokens, when forward(argmax_only=True)
    scores: list[list[TokenLogprob] | None] = field(default_factory=list)   # per item: its score_tokens' logprobs


def resolve_model(name: str) -> Path:
    if default_models.is_builtin(name):
        return default_models.materialize(name)
    return resolve_model_path(name)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on a CPU in anonymous memory the kernel zeroes a page at a time when first touched
    (torch.zeros writes every byte up front: about 2 s of an engine's start for the default 1 GiB
    KV cache, and resident memory for blocks no request ever uses). Huge pages where the kernel
    gives them on request: fewer faults and TLB misses in the per-layer KV gathers."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    try:
        memory = mmap.mmap(-1, nbytes)
    except OSError as e:      # more than the machine can map (an oversized kv_cache_gb): say how much
        raise ValueError(f"cannot allocate {nbytes / 2**30:.1f} GiB for the KV cache ({e.strerror}); "
                         "lower kv_cache_gb") from None
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)   # keeps `memory` alive


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        if config.tp_size != tp_size():
            raise ValueError(f"tp_size={config.tp_size} but this process is in a tensor-parallel group of {tp_size()}; "
                             "tp_size > 1 runs through the cluster package (a Ray TP group)")
        if self.device.type == "cpu":
            keep_large_allocations()
        self.model_path = resolve_model(config.model)
        try:
            self.hf_config = AutoConfig.from_pretrained(self.model_path)
        except (OSError, ValueError, ArithmeticError) as e:     # garbage, empty, impossible sizes (0 heads)
            raise ValueError(f"model {config.model!r}: cannot read its config.json: {_first_line(e)}") from None
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_token_ids = self._eos_token_ids()
        model_cls = model_class_for(self.hf_config)
        prev_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_cls(self.hf_config)
        except (ArithmeticError, RuntimeError, ValueError) as e:   # sizes no model can have (0 heads, a negative length)
            raise ValueError(f"model {config.model!r}: its config.json does not describe a model this engine "
                             f"can build: {type(e).__name__}: {_first_line(e)}") from None
        finally:
            torch.set_default_dtype(prev_dtype)
        load_weights(self.model, self.model_path)
        self.model.eval()
        self.model.lm_head.prepare_greedy()
        gemm_paths.tune_module(self.model, group=True)
        self.attn_layers = self.model.attention_layers()
        self.num_kv_blocks = self._allocate_kv_cache()
        self.max_model_len = self._max_model_len()

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        try:
            gen = GenerationConfig.from_pretrained(self.model_path)
            eos = gen.eos_token_id
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        except OSError:
            pass
        return ids

    def _allocate_kv_cache(self) -> int:
        a = self.attn_layers[0]
        per_token = 2 * len(self.attn_layers) * a.num_kv_heads * a.head_dim * self.dtype.itemsize
        per_block = per_token * self.config.block_size
        num_blocks = self.config.num_kv_blocks or int(self.config.kv_cache_gb * 2**30 // per_block)
        if num_blocks <= 0:
            raise ValueError(f"kv_cache_gb={self.config.kv_cache_gb} holds no block of {per_block} bytes")
        slots = num_blocks * self.config.block_size
        self.kv_cache = zeroed((2, len(self.attn_layers), slots, a.num_kv_heads, a.head_dim), self.dtype, self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        return num_blocks

    def _max_model_len(self) -> int:
        native = getattr(self.hf_config.get_text_config(), "max_position_embeddings", 8192)   # multimodal: the text part's
        limit = self.config.max_model_len or min(native, 8192)
        if limit > native:
            raise ValueError(f"max_model_len={limit} exceeds the model's context of {native} tokens")
        return min(limit, self.num_kv_blocks * self.config.block_size)

    def _drive(self, *command) -> None:
        """Rank 0 of a tensor-parallel group tells the other ranks what to run (see tp_worker.py)."""
        if tp_size() > 1 and tp_rank() == 0:
            broadcast_from_rank0(command)

    def forward(self, items: list[ForwardItem], aux_layers: tuple[int, ...] = (),
                argmax_only: bool = False) -> ForwardResult:
        """`argmax_only`: every logit row is consumed greedily (no logprobs), so return the argmax
        and skip full-vocabulary logits where the LM head can (see layers/argmax_screen.py);
        otherwise the rows' LM head, run now for items that want full logits (all of them under
        tensor parallelism) and for the others when asked (logit_rows.py)."""
        self._drive("forward", items, aux_layers, argmax_only)
        return self.forward_local(items, aux_layers, argmax_only)

    @torch.inference_mode()
    def forward_local(self, items: list[ForwardItem], aux_layers: tuple[int, ...] = (),
                      argmax_only: bool = False) -> ForwardResult:
        """This rank's share of `forward`, without telling the other ranks (tp_worker.py calls it)."""
        seqs, slot_mapping, token_ids, positions, logit_index, offsets, full = [], [], [], [], [], [], []
        start = 0
        for it in items:
            n, ctx = len(it.token_ids), len(it.ctx_slots)
            offsets.append(start)
            seqs.append(SeqAttention(
                q_start=start, q_positions=it.positions,
                kv_slots=torch.cat([it.ctx_slots, it.new_slots]),
                kv_positions=torch.cat([torch.arange(ctx), it.positions]),
                new_token_mask=it.new_token_mask))
            slot_mapping.append(it.new_slots)
            token_ids.extend(it.token_ids)
            positions.append(it.positions)
            if it.full_logits or tp_size() > 1:
                full.extend(range(len(logit_index), len(logit_index) + len(it.logit_rows)))
            logit_index.extend(start + r for r in it.logit_rows)
            start += n
        slot_mapping = torch.cat(slot_mapping)
        ctx = build_context(seqs, slot_mapping, self.device)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.cat(positions).to(self.device)
        with attention_context(ctx):
            out = self.model(input_ids, pos, aux_layers=aux_layers)
        hidden, aux = (out if aux_layers else (out, []))
        idx = torch.tensor(logit_index, dtype=torch.long, device=self.device)
        scores = [self._score(hidden, o, it) if it.score_tokens else None for o, it in zip(offsets, items)]
        if argmax_only and logit_index:
            return ForwardResult(rows=None, hidden=hidden, aux_hidden=aux, row_offsets=offsets,
                                 argmax=self.model.greedy_tokens(hidden[idx]), scores=scores)
        rows = LogitRows(self.model, hidden[idx], full)
        return ForwardResult(rows=rows, hidden=hidden, aux_hidden=aux, row_offsets=offsets, scores=scores)

    def _score(self, hidden: torch.Tensor, offset: int, item: ForwardItem) -> list[TokenLogprob]:
        """Logprobs of `item.score_tokens` under the rows before them, reduced to top-k block by
        block, so a long prompt never holds more than SCORE_BLOCK_ROWS rows of full logits."""
        out = []
        toks = item.score_tokens
        for s in range(0, len(toks), SCORE_BLOCK_ROWS):
            block = toks[s:s + SCORE_BLOCK_ROWS]
            logits = self.model.compute_logits(hidden[offset + s:offset + s + len(block)])  # TP: every rank gathers
            if tp_rank() == 0:      # the only rank whose scores anyone reads
                out.extend(token_logprobs(logits, block, [item.score_top] * len(block)))
        return out

    def copy_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move K/V of kept draft tokens into place, in every layer at once (on every rank)."""
        if len(src):
            self._drive("copy_kv", src, dst)
            self.copy_kv_local(src, dst)

    def copy_kv_local(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """This rank's share of `copy_kv`, without telling the other ranks (tp_worker.py calls it)."""
        if len(src):
            src, dst = src.to(self.device), dst.to(self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def gather_vocab(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full copies of the target's token table and LM head (vocab-sharded under TP), for a draft
        head that runs on rank 0 alone; every rank joins the gather."""
        self._drive("gather_vocab")
        return self.gather_vocab_local()

    @torch.inference_mode()
    def gather_vocab_local(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of `gather_vocab` (tp_worker.py calls it; the result is dropped there)."""
        embed, head = self.model.model.embed_tokens, self.model.lm_head
        table = all_gather_rows(embed.weight)[:embed.num_embeddings]
        if head.weight is embed.weight:
            return table, table
        return table, all_gather_rows(head.weight)[:head.num_embeddings]

    def shutdown(self) -> None:
        self._drive("stop")

    def keep_alive(self) -> None:
        """Ranks 1..n-1 wait for the next command in a collective, which times out with the process
        group (cluster/tp_group.py): rank 0 sends an idle group a no-op now and then."""
        self._drive("noop")
