"""The engine: requests in, one scheduler step at a time, tokens out. Not thread-safe (the server drives it from
one thread, see async_engine.py)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from vtengine import levers as lever_registry
from vtengine.backends import make_backend
from vtengine.config import ConfigError, EngineConfig, ModelConfig
from vtengine.engine.block_manager import BlockManager
from vtengine.engine.model_runner import InFlight, ModelRunner
from vtengine.engine.outputs import CompletionOutput, RequestOutput
from vtengine.engine.sampling_params import RequestError, SamplingParams
from vtengine.engine.scheduler import Scheduler
from vtengine.engine.sequence import Sequence
from vtengine.models.decoder import DecoderModel
from vtengine.models.presets import load_preset, package_file, preset_names, random_weights

CPU_KV_CACHE_BYTES = 512 * 2**20       # the KV pool on CPU hosts (GPU hosts size it from free memory)
GPU_ACTIVATION_RESERVE = 2 * 2**30
# max_num_seqs when not set: as many running sequences as the KV pool holds at TYPICAL_SEQ_TOKENS each (or
# max_model_len when shorter), at most MAX_NUM_SEQS_CAP, the largest captured CUDA graph and vLLM's default. A
# sequence that outgrows its share is preempted and recomputed later, as in vLLM, so this only bounds the batch.
TYPICAL_SEQ_TOKENS = 2048
MAX_NUM_SEQS_CAP = 256


def auto_max_num_seqs(num_blocks: int, block_size: int, max_model_len: int) -> int:
    """Running sequences the KV pool of ``num_blocks`` blocks admits at TYPICAL_SEQ_TOKENS (or max_model_len) each,
    between 1 and MAX_NUM_SEQS_CAP."""
    per_seq = -(-min(max_model_len, TYPICAL_SEQ_TOKENS) // block_size)
    return max(1, min(MAX_NUM_SEQS_CAP, num_blocks // per_seq))


def load_model_source(name_or_path: str, device, dtype):
    """(ModelConfig, state dict, tokenizer, display name) for a preset name, an HF directory or a .gguf file."""
    from vtengine import tokenizer as tok

    path = Path(name_or_path)
    if name_or_path in preset_names():
        preset = load_preset(name_or_path)
        source = preset.get("source")
        if source == "random":
            cfg = ModelConfig.from_hf(preset["hf_config"])
            weights = random_weights(cfg, seed=int(preset.get("seed", 0)), device=device, dtype=dtype)
            tokenizer = tok.ByteTokenizer(vocab_size=cfg.vocab_size)
            return cfg, weights, tokenizer, name_or_path
        from vtengine.models import loader
        if source == "gguf":
            gguf_path = package_file(preset["path"])
            cfg, weights = loader.load_gguf(gguf_path)
            return cfg, weights, tok.load_tokenizer(gguf_path), name_or_path
        raise ConfigError(f"preset {name_or_path!r}: source {source!r} is not one of 'random', 'gguf', 'hf'")
    from vtengine.models import loader
    if path.suffix == ".gguf" and path.is_file():
        cfg, weights = loader.load_gguf(path)
        return cfg, weights, tok.load_tokenizer(path), path.stem
    if path.is_dir():
        cfg, weights = loader.load_hf_checkpoint(path)
        try:
            tokenizer = tok.load_tokenizer(path)
        except ConfigError as e:
            # a checkpoint saved without tokenizer files (e.g. random weights for benchmarking): token-id prompts
            # still work; text goes through bytes
            print(f"vtengine: {e}; using a byte tokenizer (token-id prompts are unaffected)", file=sys.stderr)
            tokenizer = tok.ByteTokenizer(vocab_size=max(cfg.vocab_size, 259))
        return cfg, weights, tokenizer, path.name
    raise ConfigError(f"model {name_or_path!r} is neither a known preset ({preset_names()}) nor an existing "
                      f"HF checkpoint directory or .gguf file")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' was asked for but CUDA is not available on this host")
        dtype_name = config.dtype or ("bfloat16" if device.type == "cuda" else "float32")
        if dtype_name not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"dtype {dtype_name!r} is not supported; accepted: bfloat16, float16, float32")
        dtype = getattr(torch, dtype_name)
        backend_name = config.backend or ("triton" if device.type == "cuda" else "torch")
        self.levers = lever_registry.resolve(config.levers, quant=config.quant)
        self.backend = make_backend(backend_name, self.levers, config.triton_kernels)
        self.device, self.dtype = device, dtype

        cfg, weights, self.tokenizer, self.model_name = load_model_source(config.model, device, dtype)
        self.model_config = cfg
        self.model = DecoderModel(cfg, weights, self.backend, quant=config.quant, dtype=dtype, device=device)
        del weights
        requested_len = config.max_model_len or cfg.max_position_embeddings     # the model's own, by default
        self.eos_token_ids = set(self.tokenizer.eos_token_ids or cfg.eos_token_id)

        block_bytes = (2 * cfg.num_hidden_layers * config.block_size * cfg.num_key_value_heads * cfg.head_dim
                       * torch.finfo(dtype).bits // 8)
        if config.num_kv_blocks:
            num_blocks = config.num_kv_blocks
        elif device.type == "cuda":
            # gpu_memory_utilization is this instance's share of the whole GPU (as in vLLM), so two servers of
            # 0.45 each can sit side by side; the share is also bounded by what is actually free
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info(device)
            own = torch.cuda.memory_reserved(device)
            budget = min(total * config.gpu_memory_utilization - own, free) - GPU_ACTIVATION_RESERVE
            num_blocks = int(budget // block_bytes)
        else:
            num_blocks = int(CPU_KV_CACHE_BYTES // block_bytes)
        if num_blocks < 1:
            raise ConfigError(f"no room for the KV cache ({num_blocks} blocks): lower the model size or raise "
                              f"gpu_memory_utilization (now {config.gpu_memory_utilization})")
        # max_model_len: as asked (or the model's maximum), at most what the model was trained for and, unless asked
        # for explicitly, what the KV pool holds (as vLLM sizes it); an explicit length the pool cannot hold is
        # kept, and its requests are refused at the pool's size (max_seq_tokens)
        self.max_model_len = min(requested_len, cfg.max_position_embeddings)
        if config.max_model_len is None:
            self.max_model_len = min(self.max_model_len, num_blocks * config.block_size)
        blocks_per_seq = (self.max_model_len + config.block_size - 1) // config.block_size
        self.block_manager = BlockManager(num_blocks, config.block_size)
        # a prefill step never exceeds the budget: longer prompts are prefilled in chunks (vtengine/engine/scheduler.py)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_seq_tokens = min(self.max_model_len, num_blocks * config.block_size)
        # an explicit max_num_seqs is honoured as given; otherwise the pool sizes it
        self.max_num_seqs = config.max_num_seqs or auto_max_num_seqs(num_blocks, config.block_size,
                                                                     self.max_model_len)
        self.scheduler = Scheduler(self.block_manager, self.max_num_seqs, self.max_num_batched_tokens,
                                   self.max_seq_tokens)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, self.max_model_len,
                                  self.max_num_seqs, config.cuda_graphs)
        self.set_step_levers(self.levers)       # after the runner: chunk_graphs captures its graphs there
        self.blocks_per_seq = blocks_per_seq
        self.seqs: dict[str, Sequence] = {}
        self.fault = None                   # a deliberate fault of a gate's self-check (vtengine/faults.py)
        self._in_flight = None              # async scheduling: the step launched last, not read yet
        self._last_collect: float | None = None   # async scheduling: when the previous step's ids were read
        self._seed_gen = torch.Generator().manual_seed(config.seed)
        self._stats = dict(tokens_generated_total=0, prompt_tokens_total=0, requests_finished_total=0,
                           step_time_s_last=0.0, step_time_s_sum=0.0, steps_total=0, decode_steps_total=0,
                           decode_time_s_sum=0.0)

    # -- requests ----------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty; give a non-empty string or a list of token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
                   or not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise RequestError(f"prompt token ids must be integers in [0, {self.model_config.vocab_size}); "
                                   f"got {bad[:5]}")
        else:
            raise RequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise RequestError("prompt is empty; give a non-empty string or a list of token ids")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> Sequence:
        """Queue a request. ``arrival_time`` (``time.perf_counter()``) is when it reached the server, so that queue
        time and TTFT include the wait before the engine thread picked it up; default: now. Returns the sequence,
        whose ``times`` the step stamps."""
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in use")
        ids = self.encode_prompt(prompt)
        if len(ids) + params.max_tokens > self.max_seq_tokens:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {len(ids) + params.max_tokens} "
                f"exceeds the model's maximum length of {self.max_seq_tokens} tokens")
        seq = Sequence(request_id, ids, params, self.config.block_size, arrival_time)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_gen))
        if not params.greedy:
            self.runner.generators[seq.seq_id] = torch.Generator(device=self.device).manual_seed(seed)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        self._stats["prompt_tokens_total"] += len(ids)
        return seq

    def abort_request(self, request_id: str) -> None:
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self._forget(seq)
        self._settle()

    @property
    def async_scheduling(self) -> bool:
        """The lever async_scheduling: one step in flight; its sampled ids reach the next step's embedding through
        the device token mirror (lever async_device_mirror), and the host reads them a step later. Read from the
        backend's levers, so a gate can re-resolve them on an idle engine."""
        return self.backend.levers.on("async_scheduling")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def _forget(self, seq: Sequence) -> None:
        self.seqs.pop(seq.request_id, None)
        self.runner.generators.pop(seq.seq_id, None)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids:
            return "stop"
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        pending = seq.num_pending               # positions of a step launched since (async): not generated yet
        if seq.num_completion_tokens - pending >= p.max_tokens or len(seq) - pending >= self.max_seq_tokens:
            return "length"
        return None

    def set_step_levers(self, resolved) -> None:
        """Apply the levers that shape steps from resolved lever values: the backends read their levers per call, the
        scheduler holds chunked_prefill, mixed_steps, chunk_above and whole_first, the runner chunk_graphs (captured for
        chunked_prefill's N when new). A gate that re-resolves the levers of a built engine calls this too, so an
        inert or stuck lever really is one."""
        self.scheduler.prefill_chunk = int(resolved.chunked_prefill) if resolved.on("chunked_prefill") else None
        self.scheduler.mixed_steps = resolved.on("mixed_steps")
        self.scheduler.chunk_above = int(resolved.chunk_above) if resolved.on("chunk_above") else None
        self.scheduler.whole_first = resolved.on("whole_first")
        self.runner.set_chunk_graphs(self.scheduler.prefill_chunk if resolved.on("chunk_graphs") else None)

    # -- one step ----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step. Synchronous: schedule, run, read the sampled ids, append, stop checks, outputs.
        With async scheduling: schedule and launch the next step, then read the one launched before it (the host
        prepares step N+1 while the device runs step N); outputs are the previous step's."""
        if self.async_scheduling:
            return self._step_async()
        if self._in_flight is not None:     # the lever went off with a step in flight: read that one first
            return self._collect(self._in_flight, None)
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        t0 = time.perf_counter()
        sampling = self._scheduled(seqs, t0)
        tokens = self.runner.run(seqs, is_prefill, sampling)
        if not sampling and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)     # a chunk that samples nothing: its time is still the step's
        t1 = time.perf_counter()        # .tolist() in the sampler synchronized the device
        self._count_step(is_prefill, t1 - t0)
        return self._outputs(sampling, tokens, t0, t1)

    @staticmethod
    def _scheduled(seqs: list[Sequence], t0: float) -> list[Sequence]:
        """Stamp the first scheduling of each sequence; return those the step samples a token for (a prefill chunk
        that stops short of its prompt's end samples nothing)."""
        for s in seqs:
            if s.times.first_scheduled is None:
                s.times.first_scheduled = t0
        return [s for s in seqs if s.samples_this_step]

    def _step_async(self) -> list[RequestOutput]:
        seqs, is_prefill = self.scheduler.schedule()
        t0 = time.perf_counter()
        launched = None
        if seqs:
            sampling = self._scheduled(seqs, t0)
            launched = self.runner.launch(seqs, is_prefill, started=t0, sampling=sampling)
            for s in sampling:
                s.add_pending()         # its position exists from now on; its token arrives with the collection
        if self._in_flight is None:
            self._in_flight = launched
            return []
        outputs = self._collect(self._in_flight, launched)
        self._settle()
        return outputs

    def _collect(self, step: InFlight, launched: InFlight | None) -> list[RequestOutput]:
        """Read a launched step's sampled ids (``launched``, the step after it, is in flight from now on)."""
        self._in_flight = launched
        tokens = self.runner.collect(step)
        t1 = time.perf_counter()
        # A step's time is from its launch, or from the previous read if that came later, to its read: with one
        # step in flight, launch-to-read spans the step before it too (up to two device steps), so the steps'
        # times summed over a generation would exceed its wall time; this way they add up to it.
        start = step.started if self._last_collect is None else max(step.started, self._last_collect)
        self._last_collect = t1
        self._count_step(step.is_prefill, t1 - start)
        live = [(s, tok) for s, tok in zip(step.seqs, tokens) if not s.is_finished]     # aborted since: dropped
        return self._outputs([s for s, _ in live], [tok for _, tok in live], step.started, t1)

    def _settle(self) -> None:
        """With nothing left to schedule, read a step in flight whose sequences all finished since (their last
        tokens are discarded), so an engine without requests is idle."""
        step = self._in_flight
        if step is not None and not self.scheduler.has_unfinished() and all(s.is_finished for s in step.seqs):
            self._collect(step, None)

    def _count_step(self, is_prefill: bool, dt: float) -> None:
        st = self._stats
        st["step_time_s_last"], st["steps_total"] = dt, st["steps_total"] + 1
        st["step_time_s_sum"] += dt
        if not is_prefill:
            st["decode_steps_total"] += 1
            st["decode_time_s_sum"] += dt

    def _outputs(self, seqs: list[Sequence], tokens: list[int], t0: float, t1: float) -> list[RequestOutput]:
        """Append each sequence's new token, check its stops, finish it; one RequestOutput per sequence."""
        st = self._stats
        outputs = []
        for seq, tok in zip(seqs, tokens):
            times = seq.times                   # timing hooks: read by the server's latency histograms
            if times.first_scheduled is None:
                times.first_scheduled = t0
            times.token_times.append(t1)
            if seq.has_pending:
                seq.resolve_pending(tok)
            else:
                seq.append_token(tok)
            st["tokens_generated_total"] += 1
            reason = self._finish_reason(seq, tok)
            if reason is not None:
                times.finished = t1
                self.scheduler.finish(seq, reason)
                self._forget(seq)
                st["requests_finished_total"] += 1
            outputs.append(RequestOutput(
                request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
                outputs=[CompletionOutput(0, seq.completion_token_ids, finish_reason=reason)],
                finished=reason is not None, new_token_ids=[tok]))
        return outputs

    @torch.inference_mode()
    def score(self, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
        """Teacher forcing: log-probabilities [len(completion_ids), vocab] of each completion position given the
        prompt and the completion tokens before it (vLLM's prompt_logprobs, over the completion). Runs one prefill
        through the paged cache; needs no other request in flight."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("score() needs an idle engine (requests are in flight)")
        ids = list(prompt_ids) + list(completion_ids)
        seq = Sequence("score", ids, SamplingParams(max_tokens=1), self.config.block_size)
        if len(ids) > self.max_seq_tokens or not self.block_manager.can_allocate(seq):
            raise RequestError(f"cannot score {len(ids)} tokens (maximum {self.max_seq_tokens})")
        self.block_manager.allocate(seq)
        try:
            input_ids, positions, ctx = self.runner.prepare_prefill([seq])
            start = len(prompt_ids) - 1
            ctx.last_token_idx = torch.arange(start, len(ids) - 1, device=self.device)
            hidden = self.model.forward(input_ids, positions, ctx, self.runner.kv_caches)
            return torch.log_softmax(self.model.logits(hidden).double(), dim=-1)
        finally:
            self.block_manager.free(seq)

    def stats(self) -> dict:
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
        return dict(self._stats, num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                    kv_blocks_total=self.block_manager.num_blocks, kv_blocks_free=self.block_manager.num_free,
                    max_num_seqs=self.max_num_seqs,
                    num_preemptions=self.scheduler.num_preemptions, peak_gpu_memory_bytes=peak)
