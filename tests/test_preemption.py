"""Preemption by recompute under seeded sampling: a preempted request goes on exactly where it stopped.

Greedy decoding cannot tell a preemption that keeps the generated tokens from one that forgets them: greedy
regenerates the same tokens. A seeded request can, because its generator has moved on by one draw per token, so
a request that restarts its completion draws different tokens than an undisturbed run of the same request.
"""
import torch

from vtengine import LLM, SamplingParams

MAX_TOKENS = 20
NUM_SMALL_BLOCKS = 6        # 16-token blocks; the longest request needs 64 + 20 tokens = 6 blocks on its own


def prompts_and_params():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 3, 17, 16, 33, 5, 64, 9)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1000 + i, ignore_eos=True)
              for i in range(len(prompts))]
    return prompts, params


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_requests_survive_preemption_token_for_token():
    prompts, params = prompts_and_params()
    big = LLM(model="tiny", backend="torch", num_kv_blocks=64, max_num_seqs=8)
    expected = token_ids(big.generate(prompts, params))
    assert big.engine.scheduler.num_preemptions == 0

    small = LLM(model="tiny", backend="torch", num_kv_blocks=NUM_SMALL_BLOCKS, max_num_seqs=8)
    scheduler = small.engine.scheduler
    generated_at_preemption = []            # completion tokens a request had when it was preempted
    preempt = scheduler.preempt

    def recording_preempt(seq):
        generated_at_preemption.append(seq.num_completion_tokens)
        preempt(seq)

    scheduler.preempt = recording_preempt
    got = token_ids(small.generate(prompts, params))

    assert scheduler.num_preemptions == len(generated_at_preemption) > 0
    # preempted mid-completion, with tokens to keep (a preemption before the first token would prove nothing)
    assert max(generated_at_preemption) >= 8
    assert got == expected
    assert all(len(t) == MAX_TOKENS for t in got)
    assert small.engine.block_manager.num_free == NUM_SMALL_BLOCKS
    assert small.engine.runner.generators == {}          # finished requests give their generators back

    # the test would be blind if these requests sampled like greedy ones or like each other
    greedy = token_ids(big.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                            ignore_eos=True)))
    assert all(s != g for s, g in zip(got, greedy))
    assert len({tuple(t) for t in got}) == len(prompts)
