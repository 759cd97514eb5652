"""Builds each step's inputs (positions, slot mapping, block tables, context lengths), runs the model eagerly or by
CUDA-graph replay, and samples.

CUDA graphs: decode steps are captured once per batch size in ``graph_batch_sizes`` with static input buffers;
a step of B sequences replays the smallest captured size >= B with the extra rows padded (slot -1: nothing is
written; context length 1 over block 0: read and discarded). Split-KV decode attention must not read the step's
context lengths on the host, so every decode step (graphed or eager, hence bitwise equal) takes its split count
from ``max_model_len``; each sequence divides its own context over those splits.

Prefill runs eagerly, except under the lever chunk_graphs: a step whose prefill part is one sequence's full chunk
of chunked_prefill's N tokens (with or without mixed_steps' decode rows after it) replays a graph captured for N
prefill rows plus a decode batch size, padded like a decode step. Its kernels read every length from device
buffers (the prefill sequence's context length and block table, the decode rows' own), so one graph serves every
chunk of every prompt; the host then spends a replay instead of queueing ~330 launches (14-31 ms per Qwen3-8B step
on the H200, more than the device needs for a 512-token chunk at a short context). Where CUDA graphs do not exist
(the CPU), the same static buffers run the forward eagerly, so the buffer handling is tested there.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from vtengine import counters
from vtengine.engine.sampler import Sampler
from vtengine.engine.sequence import Sequence
from vtengine.engine.transfer import to_device
from vtengine.models.decoder import AttnContext, DecoderModel

log = logging.getLogger(__name__)
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
BLOCK_TABLE_ALIGN = 64      # block-table widths are rounded up to this many columns (few distinct shapes)


@dataclass
class InFlight:
    """A launched step whose sampled ids the host has not read yet (async scheduling): the ids on the device (the
    device token mirror the next step's embedding reads), their host copy under way, and the event that says when
    that copy is done."""
    seqs: list[Sequence]
    is_prefill: bool
    ids: torch.Tensor                       # [len(seqs)] int64 on the device
    host: torch.Tensor                      # [len(seqs)] int64 on the host (pinned on CUDA), filled asynchronously
    event: object | None                    # torch.cuda.Event recorded after the copy (None on CPU: copies are done)
    rows: dict[int, int] = field(default_factory=dict)     # seq_id -> row of ids
    started: float = 0.0
    host_pending: bool = True               # the host has not read ``host`` yet


@dataclass
class ChunkGraphs:
    """Static inputs and captured steps of the lever chunk_graphs: ``chunk`` prefill rows (one sequence), then up to
    ``max_decode`` decode rows; ``steps[bs]`` runs the forward and logits over the first ``chunk + bs`` rows and
    leaves ``out[bs]``: row 0 the chunk's last token, rows 1..bs the decode rows."""
    chunk: int
    ids: torch.Tensor                   # [chunk + max_decode] int64
    pos: torch.Tensor                   # [chunk + max_decode] int64
    slots: torch.Tensor                 # [chunk + max_decode] int64, -1 on padded rows (nothing written)
    context_len: torch.Tensor           # [1] int32: the chunk's end in its sequence
    block_table: torch.Tensor           # [1, max_blocks] int32
    decode_lens: torch.Tensor           # [max_decode] int32, 1 on padded rows
    decode_tables: torch.Tensor         # [max_decode, max_blocks] int32, 0 on padded rows
    steps: dict = field(default_factory=dict)      # bs -> torch.cuda.CUDAGraph, or a callable on the CPU
    out: dict = field(default_factory=dict)        # bs -> logits [1 + bs, vocab], rows of the runner's logits_buf
    # bs -> the AttnContext captured into steps[bs]: it owns tensors made for it (cu_seqlens_q, last_token_idx) that
    # a graph reads by address, so it lives as long as the graph (freed, their memory is reused under the replay)
    ctxs: dict = field(default_factory=dict)

    @property
    def max_decode(self) -> int:
        return self.decode_lens.shape[0]


class ModelRunner:
    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, cuda_graphs: bool):
        self.model, self.block_size, self.max_model_len = model, block_size, max_model_len
        self.device, self.dtype = model.device, model.dtype
        cfg = model.cfg
        self.max_blocks_per_seq = (max_model_len + block_size - 1) // block_size
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(cfg.num_hidden_layers)]
        self.sampler = Sampler(model.backend)
        self.generators: dict[int, torch.Generator] = {}
        self.graphs: dict = {}              # batch size -> torch.cuda.CUDAGraph (a callable on the CPU)
        self.graph_pool = None              # the memory pool every captured graph shares
        # the logits every captured graph writes (rows of one buffer: a step's sampler reads them before the next
        # replay, in stream order); a buffer outgrown by a later capture lives on in the views its graphs return
        self.logits_buf: torch.Tensor | None = None
        self.chunk_graphs: ChunkGraphs | None = None
        self.fault = None                   # a deliberate fault of a gate's self-check (vtengine/faults.py)
        self.mirror: InFlight | None = None   # async scheduling: the last launched step (its ids stay on the device)
        self.use_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        if self.use_graphs and not model.backend.capturable:
            # e.g. the torch backend (the oracle) on a GPU: its references synchronise with the host, so a capture
            # would be invalidated; decode runs eagerly instead, and says so
            log.warning("CUDA graphs off: backend %s runs %s through host-synchronising torch references",
                        model.backend.name, ", ".join(model.backend.host_sync_ops()))
            self.use_graphs = False
        if self.use_graphs:
            self.capture_graphs(max_num_seqs)
        # chunk graphs are captured where decode graphs could be (whatever use_graphs is switched to later), and on
        # the CPU as static buffers run eagerly
        self.can_capture = self.use_graphs or self.device.type != "cuda"
        self.max_num_seqs = max_num_seqs

    # -- inputs -----------------------------------------------------------------------------------------------
    def _block_tables(self, seqs: list[Sequence], out: torch.Tensor | None = None) -> torch.Tensor:
        """[B, W] int32, -1 padded, W the longest table rounded up to BLOCK_TABLE_ALIGN columns: the kernels read a
        row only up to its own context, so the columns past every sequence's blocks are never needed. Built in
        numpy: at the model's full length (2,560 columns for 40,960 tokens) a full-width torch build took 2.6 ms per
        step at 128 sequences on a CPU core, this 0.25 ms, and the copy to the device is W columns, not 2,560.
        ``out``: a wider table (the decode graphs' static one) whose first B rows and W columns take it; its columns
        past W keep what they held, which no kernel reads for the same reason."""
        width = max(1, max(len(s.block_table) for s in seqs))
        width = min(self.max_blocks_per_seq, -(-width // BLOCK_TABLE_ALIGN) * BLOCK_TABLE_ALIGN)
        rows = np.full((len(seqs), width), -1, dtype=np.int32)
        for i, s in enumerate(seqs):
            rows[i, :len(s.block_table)] = s.block_table
        return to_device(torch.from_numpy(rows), torch.int32, self.device,
                         out=None if out is None else out[:len(seqs), :width])

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare_prefill(self, seqs: list[Sequence]):
        """Each sequence's next ``num_new_tokens`` tokens (its whole uncached rest when unset: scoring), attending to
        everything before them in the cache; logits rows only for the sequences whose chunk ends their prefill.

        A mixed step (the lever mixed_steps): the sequences still prefilling come first, the decoding ones after
        them; the decoding rows go last in the batch (their inputs as a decode step builds them, the device token
        mirror included) and attend through ``ctx.decode``, and every one of them has a logits row."""
        # a decoding row: scheduled for one token after its prompt (a scored sequence is neither: it prefills whole)
        n_pre = sum(s.in_prefill or s.num_new_tokens != 1 for s in seqs)
        if any(not s.in_prefill and s.num_new_tokens == 1 for s in seqs[:n_pre]):
            raise ValueError("a mixed step lists its prefilling sequences first, then its decoding ones")
        decoding = seqs[n_pre:]
        seqs = seqs[:n_pre]
        ids, pos, slots, cu, last, ends = [], [], [], [0], [], []
        for s in seqs:
            start = s.num_cached_tokens
            end = min(len(s), start + s.num_new_tokens) if s.num_new_tokens else len(s)
            ends.append(end)
            ids.extend(s.token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(self._slot(s, p) for p in range(start, end))
            cu.append(cu[-1] + end - start)
            if end == len(s):
                last.append(cu[-1] - 1)
        dev = self.device
        dec = None
        if decoding:
            last.extend(range(cu[-1], cu[-1] + len(decoding)))
            pos.extend(len(s) - 1 for s in decoding)
            slots.extend(self._slot(s, len(s) - 1) for s in decoding)
            d_ids, _, dec = self.prepare_decode(decoding, positions=False)
        ctx = AttnContext(
            is_prefill=True,
            slot_mapping=to_device(slots, torch.int64, dev),
            context_lens=to_device(ends, torch.int32, dev),
            block_tables=self._block_tables(seqs),
            cu_seqlens_q=to_device(cu, torch.int32, dev),
            last_token_idx=to_device(last, torch.int64, dev),
            max_context_len=max(len(s) for s in seqs),
            decode=dec,
        )
        ids = to_device(ids, torch.int64, dev)
        if decoding:
            ids = torch.cat([ids, d_ids])
            # the mechanism gate's proof of mixed_steps: (decode rows, prefill rows) of each mixed step that ran
            counters.record("mixed_step", "decode_rows", grid=(len(decoding), cu[-1]))
        return ids, to_device(pos, torch.int64, dev), ctx

    def prepare_decode(self, seqs: list[Sequence], positions: bool = True, static: bool = False):
        """A decode step's inputs (``positions=False``: the decoding part of a mixed step, whose positions and
        slots the prefill context carries). ``static``: written straight into the first B rows of the decode
        graphs' static buffers (one host-to-device copy each, no device tensor in between), which ``_replay``
        then replays."""
        dev, b = self.device, len(seqs)
        if static and not positions:
            raise ValueError("prepare_decode: static inputs are a whole decode step's, positions included")
        g = self.g_ctx if static else None
        ids = self._decode_ids(seqs)
        if static:
            ids = self.g_ids[:b].copy_(ids)
        pos = (to_device([len(s) - 1 for s in seqs], torch.int64, dev, out=self.g_pos[:b] if static else None)
               if positions else None)
        ctx = AttnContext(
            is_prefill=False,
            slot_mapping=(to_device([self._slot(s, len(s) - 1) for s in seqs], torch.int64, dev,
                                    out=g.slot_mapping[:b] if static else None) if positions else None),
            context_lens=to_device([len(s) for s in seqs], torch.int32, dev,
                                   out=g.context_lens[:b] if static else None),
            block_tables=self._block_tables(seqs, out=g.block_tables if static else None),
            # split count from max_model_len in eager and graphed decode alike, so the two are bitwise equal
            max_context_len=self.max_model_len,
        )
        return ids, pos, ctx

    def _decode_ids(self, seqs: list[Sequence]) -> torch.Tensor:
        """Each sequence's newest token, on the device. A token the step in flight sampled (PENDING on the host)
        comes from that step's ids on the device (the device token mirror), gathered there without a host sync, or
        taken as they are when the batch is that step's in its order (steady decode); with the mirror off it comes
        from the host, which holds only the token before it: the stale read of a plain async port, kept so a gate
        can show the race."""
        dev = self.device
        stale = self.fault is not None and self.fault.kind == "stale_input"
        # the stale_input fault on a sequence whose newest token is in flight: the host's copy (the one before it)
        device_mirror = self.model.backend.levers.on("async_device_mirror") and not stale
        host, src = [], []
        pending = False
        for s in seqs:
            if s.has_pending:
                pending = True
                row = self.mirror.rows.get(s.seq_id, -1) if (self.mirror is not None and device_mirror) else -1
                src.append(row)
                host.append(s.last_known_token())
            else:
                src.append(-1)
                # a deliberate fault (stale_input): the token before the newest, as a racy async step would read it
                host.append(s.token_ids[-2] if stale and s.num_completion_tokens > 1 else s.last_token)
        if src and self.mirror is not None and src == list(range(self.mirror.ids.shape[0])):
            # steady decode: every row's newest token is the step in flight's, in its order: its ids are these ids
            # (the gather below would give the same tensor through two copies to the device and four kernels)
            ids = self.mirror.ids
        else:
            ids = to_device(host, torch.int64, dev)
            if any(r >= 0 for r in src):
                rows = to_device(src, torch.int64, dev)
                ids = torch.where(rows >= 0, self.mirror.ids[rows.clamp(min=0)], ids)
        if pending:     # the form named from the tensor the step reads
            as_is = self.mirror is not None and ids is self.mirror.ids
            counters.record("async_inputs", "device_mirror" if device_mirror else "host_copy", grid=(len(seqs),),
                            variant="in_order" if as_is else "gathered")
        return ids

    # -- CUDA graphs -------------------------------------------------------------------------------------------
    def _graph_logits(self, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of the shared logits output, grown (never during a capture) to hold them. One
        buffer for every graph instead of one output per captured batch size: ~0.5 GB less per kind of graph for
        Qwen3-8B at 256 sequences (871 rows of the vocabulary's fp32 logits against 256)."""
        buf = self.logits_buf
        if buf is None or buf.shape[0] < rows:
            vocab = self.model.lm_head.shape[0]
            buf = self.logits_buf = torch.empty(rows, vocab, dtype=torch.float32, device=self.device)
        return buf[:rows]

    @torch.inference_mode()
    def capture_graphs(self, max_num_seqs: int) -> None:
        """One decode graph per batch size up to ``max_num_seqs`` over static input buffers. On the CPU, where no
        graphs exist, each "graph" is the same step run eagerly over those buffers: a test that captures them there
        and switches ``use_graphs`` on drives the replay's input handling (static rows, padding) without a GPU."""
        sizes = [b for b in GRAPH_BATCH_SIZES if b <= max_num_seqs] or [1]
        if sizes[-1] < max_num_seqs and max_num_seqs <= GRAPH_BATCH_SIZES[-1]:
            sizes.append(max_num_seqs)
        n, dev = max(sizes), self.device
        self.g_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.g_pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.g_ctx = AttnContext(
            is_prefill=False,
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
            context_lens=torch.ones(n, dtype=torch.int32, device=dev),
            block_tables=torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32, device=dev),
            max_context_len=self.max_model_len,
        )
        self.g_out: dict[int, torch.Tensor] = {}
        self._graph_logits(n)
        pool = None
        for bs in sorted(sizes, reverse=True):
            ctx = self.g_ctx.sliced(bs)

            # every input bound now, as a graph binds its addresses at capture (a later swap of the buffers,
            # as a gate's recapture does, must not mix these inputs with new ones)
            def step(bs=bs, ctx=ctx, ids=self.g_ids[:bs], pos=self.g_pos[:bs]):
                self.g_out[bs] = self.model.logits(self.model.forward(ids, pos, ctx, self.kv_caches),
                                                   out=self._graph_logits(bs))
            if dev.type != "cuda":       # no graphs: the same step run eagerly over the static buffers
                self.graphs[bs] = step
                continue
            for _ in range(2):                       # warm-up: compile kernels, allocate workspaces
                step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                step()
            pool = graph.pool()
            self.graphs[bs] = graph
        self.graph_pool = pool
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def set_chunk_graphs(self, chunk: int | None) -> None:
        """The lever chunk_graphs at chunk size ``chunk`` (None: off). Captures the graphs when none exist for this
        chunk, so a lever re-resolved on a built engine (a gate's stuck-lever fault, another chunk size) takes
        effect; with the lever off the captured graphs stay, unused."""
        if chunk and self.can_capture and (self.chunk_graphs is None or self.chunk_graphs.chunk != chunk):
            self.capture_chunk_graphs(chunk, self.max_num_seqs - 1)

    @torch.inference_mode()
    def capture_chunk_graphs(self, chunk: int, max_decode: int) -> None:
        """The lever chunk_graphs: one graph per decode batch size (0, then GRAPH_BATCH_SIZES up to ``max_decode``)
        over ``chunk`` prefill rows. Captured over a harmless step (prefill rows write no slot and read block 0, as
        padded decode rows do), in the decode graphs' memory pool. On the CPU each "graph" is the same forward run
        eagerly over the static buffers."""
        if chunk < 1:
            raise ValueError(f"chunk_graphs needs a chunk of at least 1 token, got {chunk}")
        max_decode = max(0, max_decode)
        sizes = [0] + [b for b in GRAPH_BATCH_SIZES if b <= max_decode]
        if sizes[-1] < max_decode <= GRAPH_BATCH_SIZES[-1]:
            sizes.append(max_decode)
        n, dev, width = chunk + sizes[-1], self.device, self.max_blocks_per_seq
        cg = self.chunk_graphs = ChunkGraphs(
            chunk=chunk,
            ids=torch.zeros(n, dtype=torch.int64, device=dev),
            pos=torch.zeros(n, dtype=torch.int64, device=dev),
            slots=torch.full((n,), -1, dtype=torch.int64, device=dev),
            context_len=torch.full((1,), chunk, dtype=torch.int32, device=dev),
            block_table=torch.zeros(1, width, dtype=torch.int32, device=dev),
            decode_lens=torch.ones(sizes[-1], dtype=torch.int32, device=dev),
            decode_tables=torch.zeros(sizes[-1], width, dtype=torch.int32, device=dev),
        )
        cu = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
        self._graph_logits(1 + sizes[-1])
        pool = self.graph_pool
        for bs in sorted(sizes, reverse=True):
            ctx = cg.ctxs[bs] = AttnContext(
                is_prefill=True, slot_mapping=cg.slots[:chunk + bs], context_lens=cg.context_len,
                block_tables=cg.block_table, cu_seqlens_q=cu,
                last_token_idx=torch.arange(chunk - 1, chunk + bs, dtype=torch.int64, device=dev),
                max_context_len=self.max_model_len,
                decode=AttnContext(False, None, cg.decode_lens[:bs], cg.decode_tables[:bs],
                                   max_context_len=self.max_model_len) if bs else None)

            def step(bs=bs, ctx=ctx):
                cg.out[bs] = self.model.logits(
                    self.model.forward(cg.ids[:chunk + bs], cg.pos[:chunk + bs], ctx, self.kv_caches),
                    out=self._graph_logits(1 + bs))
            if dev.type != "cuda":
                cg.steps[bs] = step
                continue
            for _ in range(2):                       # warm-up: compile kernels, allocate workspaces
                step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                step()
            pool = graph.pool()
            cg.steps[bs] = graph
        self.graph_pool = pool
        if dev.type == "cuda":
            torch.cuda.synchronize()
        log.info("chunk_graphs: %d-token chunks with %s decode rows captured", chunk, sorted(sizes))

    def _chunk_graph_fits(self, seqs: list[Sequence]) -> tuple[bool, int, bool]:
        """(whether this prefill step can replay a chunk graph, its decode rows, whether its chunk ends the prompt):
        exactly one prefilling sequence computing exactly the captured chunk, and at most max_decode decode rows."""
        cg = self.chunk_graphs
        if cg is None or not self.model.backend.levers.on("chunk_graphs"):
            return False, 0, False
        if self.device.type == "cuda" and not self.use_graphs:     # graphs switched off (graph_parity's eager run)
            return False, 0, False
        pre = [s for s in seqs if s.in_prefill or s.num_new_tokens != 1]
        if len(pre) != 1 or not pre[0].num_new_tokens:
            return False, 0, False
        s = pre[0]
        end = min(len(s), s.num_cached_tokens + s.num_new_tokens)
        n_dec = len(seqs) - 1
        return end - s.num_cached_tokens == cg.chunk and n_dec <= cg.max_decode, n_dec, end == len(s)

    def _chunk_replay(self, ids, pos, ctx: AttnContext, n_dec: int, ends: bool) -> torch.Tensor | None:
        """Copy a fitting step's inputs into the static buffers, replay the graph of the smallest captured decode
        batch >= n_dec, and return the rows of the sequences that sample (the chunk's last token only when the chunk
        ends its prompt, then the decode rows), as prepare_prefill's eager step would."""
        cg = self.chunk_graphs
        bs = min(b for b in cg.steps if b >= n_dec)
        t = cg.chunk + n_dec
        cg.ids[:t].copy_(ids)
        cg.pos[:t].copy_(pos)
        cg.slots.fill_(-1)
        cg.slots[:t].copy_(ctx.slot_mapping)
        cg.context_len.copy_(ctx.context_lens)
        cg.block_table.zero_()
        cg.block_table[:, :ctx.block_tables.shape[1]].copy_(ctx.block_tables.clamp(min=0))
        if n_dec:
            cg.decode_lens.fill_(1)
            cg.decode_lens[:n_dec].copy_(ctx.decode.context_lens)
            cg.decode_tables.zero_()
            dt = ctx.decode.block_tables
            cg.decode_tables[:n_dec, :dt.shape[1]].copy_(dt.clamp(min=0))
        step = cg.steps[bs]
        if isinstance(step, torch.cuda.CUDAGraph):
            step.replay()
            counters.record("chunk_step", "cuda_graph", grid=(cg.chunk, bs))
        else:
            step()
            counters.record("chunk_step", "static_eager", grid=(cg.chunk, bs))
        if not ends and not n_dec:
            return None
        return cg.out[bs][(0 if ends else 1):1 + n_dec]

    def _replay(self, b: int) -> torch.Tensor:
        """Replay the smallest captured batch size >= b over the static buffers whose first b rows
        ``prepare_decode(static=True)`` filled; the graph's rows past b are padded first (slot -1: nothing written;
        context 1 over block 0: read and discarded), as they may hold an earlier, larger step's rows. At b equal to
        a captured size nothing else runs before the replay."""
        bs = min(s for s in self.graphs if s >= b)
        if b < bs:
            g = self.g_ctx
            g.slot_mapping[b:bs].fill_(-1)
            g.context_lens[b:bs].fill_(1)
            g.block_tables[b:bs].zero_()
        graph = self.graphs[bs]
        if isinstance(graph, torch.cuda.CUDAGraph):
            graph.replay()
            counters.record("decode_step", "cuda_graph", grid=(bs,))
        else:
            graph()
            counters.record("decode_step", "static_eager", grid=(bs,))
        return self.g_out[bs][:b]

    # -- one step ----------------------------------------------------------------------------------------------
    def _logits(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor | None:
        """The step's logits, one row per sequence that samples (``Sequence.samples_this_step``, read before the
        call); None when none does (every chunk of the step stops short of its prompt's end)."""
        if is_prefill:
            fits, n_dec, ends = self._chunk_graph_fits(seqs)
            ids, pos, ctx = self.prepare_prefill(seqs)
            if fits:
                logits = self._chunk_replay(ids, pos, ctx, n_dec, ends)
            else:
                hidden = self.model.forward(ids, pos, ctx, self.kv_caches)
                logits = self.model.logits(hidden) if ctx.last_token_idx.numel() else None
            for s in seqs:
                if not s.in_prefill and s.num_new_tokens == 1:     # a decoding sequence of a mixed step
                    s.num_cached_tokens = len(s)
                else:
                    s.num_cached_tokens = min(len(s), s.num_cached_tokens + (s.num_new_tokens or len(s)))
                    s.in_prefill = s.num_cached_tokens < len(s)
            return logits
        else:
            if self.use_graphs and len(seqs) <= max(self.graphs):
                self.prepare_decode(seqs, static=True)
                logits = self._replay(len(seqs))
            else:
                ids, pos, ctx = self.prepare_decode(seqs)
                logits = self.model.logits(self.model.forward(ids, pos, ctx, self.kv_caches))
                counters.record("decode_step", "eager", grid=(len(seqs),))
        for s in seqs:
            s.num_cached_tokens = len(s)
        return logits

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool, sampling: list[Sequence] | None = None) -> list[int]:
        """One synchronous step: the sampled ids on the host (the sampler's read waits for the device), one per
        sequence that samples in it (``sampling``: those sequences, when the caller has listed them already)."""
        sampling = [s for s in seqs if s.samples_this_step] if sampling is None else sampling
        logits = self._logits(seqs, is_prefill)
        return self.sampler(logits, sampling, self.generators) if sampling else []

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], is_prefill: bool, started: float = 0.0,
               sampling: list[Sequence] | None = None) -> InFlight:
        """One step of async scheduling: everything queued on the device, nothing waited for. Its sampled ids stay
        on the device (the next step's decode inputs gather from them) and are copied to the host behind an event;
        ``collect`` reads them."""
        if self.mirror is not None and self.mirror.host_pending:
            counters.record("async_steps", "launched_ahead", grid=(len(seqs),))   # the overlap, made visible
        else:
            counters.record("async_steps", "launched_after_read", grid=(len(seqs),))
        sampling = [s for s in seqs if s.samples_this_step] if sampling is None else sampling
        logits = self._logits(seqs, is_prefill)
        ids = (self.sampler.sample(logits, sampling, self.generators) if sampling
               else torch.empty(0, dtype=torch.int64, device=self.device))
        on_cuda = ids.device.type == "cuda"
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=on_cuda)
        host.copy_(ids, non_blocking=on_cuda)
        event = None
        if on_cuda:
            event = torch.cuda.Event()
            event.record()
        step = InFlight(sampling, is_prefill, ids, host, event, {s.seq_id: i for i, s in enumerate(sampling)},
                        started)
        self.mirror = step
        return step

    def collect(self, step: InFlight) -> list[int]:
        """The host's copy of a launched step's sampled ids (waits for that copy only)."""
        if step.event is not None:
            step.event.synchronize()
        step.host_pending = False
        return step.host.tolist()

    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)
