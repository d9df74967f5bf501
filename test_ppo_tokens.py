"""Tests for ppo_tokens.py and kernels.py: every numeric piece against a plain reference (float64 where it matters),
every PPO detail with a test that fails when it breaks, and the real entry point on tiny budgets.
Run: python -m pytest -q test_ppo_tokens.py   (CPU: Triton kernels run under TRITON_INTERPRET=1; on a CUDA machine the
kernel tests run compiled on the GPU)
The slow tier (the longer demo run, kill -9 and resume, torchrun, torch.compile) runs only with PPO_TOKENS_SLOW=1, as
CI (.ci/run) runs it: PPO_TOKENS_SLOW=1 python -m pytest -q test_ppo_tokens.py"""
import os

# One intra-op thread, here and in every subprocess (which inherit it): the tiny models gain nothing from more, and on
# a busy 2-core machine more threads, plus the loop's sampler thread, made the same tests up to 20x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: its kernels then run on CPU tensors
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
os.environ["PPO_TOKENS_STRICT"] = "1"  # a fast path that falls back is an error (fall_back), here and in subprocesses

import collections
import contextlib
import dataclasses
import functools
import io
import itertools
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

import ppo_tokens as pt
kernels = pt.kernels  # kernels.py, imported by ppo_tokens under its own name (the Hub's `kernels` package has this one)

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ppo_tokens.py")
slow = pytest.mark.skipif(os.environ.get("PPO_TOKENS_SLOW") != "1",
                          reason="slow tier: PPO_TOKENS_SLOW=1 runs it (CI does)")


def tiny_llama(vocab_size, seed=0, dtype=torch.float64, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=False)
    config.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**config)).to(dtype).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return pt.build_demo_tokenizer()


def forget_modules_from(directory):  # reward modules a run imported from its directory: the next run imports its own
    directory = os.path.join(os.path.abspath(directory), "")
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(directory):
            del sys.modules[name]


@pytest.fixture(autouse=True)
def same_start(tmp_path_factory):
    """Every test starts from the same global state, whatever ran before it: in-process runs of main() seed torch's
    global generator, put their working directory on sys.path and import reward modules from it; pt.setup() sets
    the TF32 switch and the current CUDA device."""
    torch.manual_seed(0)
    threads, path, tf32 = torch.get_num_threads(), sys.path[:], torch.backends.cuda.matmul.allow_tf32
    cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    yield
    torch.set_num_threads(threads)
    sys.path[:] = path
    forget_modules_from(tmp_path_factory.getbasetemp())
    torch.backends.cuda.matmul.allow_tf32 = tf32
    if torch.cuda.is_initialized():
        torch.cuda.set_device(cuda_device)


def demo_rollout(tokenizer, policy, texts, temperature=1.0, top_k=0, top_p=1.0, T=4, seed=0):
    ids, mask = pt.left_pad(pt.format_prompts(tokenizer, texts, False, 64), tokenizer.pad_token_id, "cpu")
    batch = pt.generate(policy, ids, mask, max_new_tokens=T, temperature=temperature, stop_ids=tokenizer.eos_token_id,
                        pad_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(seed),
                        top_k=top_k, top_p=top_p)
    batch.prompts, batch.completions = texts, pt.decode_completions(tokenizer, batch)
    return batch


# ---------------------------------------------------------------------------------------------------------------
# rollout: generate, sampling, stop ids, the pad token, left padding, behaviour log-probs
# (the algorithm first, in ppo_tokens.py's reading order; then the plumbing, from the set-up and models on)


class ScriptedLM(torch.nn.Module):
    """A stand-in sampler whose step-t logits force script[b][t]; it records the position ids it is given."""

    def __init__(self, script, vocab_size):
        super().__init__()
        self.script, self.V, self.seen_positions, self.calls = torch.tensor(script), vocab_size, [], 0

    def forward(self, input_ids, attention_mask, position_ids, cache=None, use_cache=None):
        self.seen_positions.append(position_ids.clone())
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], self.V), -30.0)
        logits[torch.arange(input_ids.shape[0]), -1, self.script[:, self.calls]] = 30.0
        self.calls += 1
        return SimpleNamespace(logits=logits, cache=cache)


def test_generate_stops_per_row_at_eos_pads_after_and_keeps_eos_in_mask(tokenizer):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    d = {c: tokenizer.convert_tokens_to_ids(c) for c in "0123456789"}
    script = [[d["4"], eos, d["1"], d["1"], d["1"]],  # ends early: EOS at t=1
              [d["1"], d["2"], d["3"], d["4"], d["5"]],  # never emits EOS
              [eos, d["7"], d["7"], d["7"], d["7"]]]  # EOS first
    lm = ScriptedLM(script, len(tokenizer))
    texts = ["1+2=", "37+45=", "9+9="]  # ragged prompt lengths -> left padding
    ids, mask = pt.left_pad(pt.format_prompts(tokenizer, texts, False, 64), pad, "cpu")
    batch = pt.generate(lm, ids, mask, max_new_tokens=5, temperature=1.0, stop_ids=eos, pad_id=pad,
                        generator=torch.Generator().manual_seed(0), policy_version=3)
    assert batch.response.tolist() == [[d["4"], eos, pad, pad, pad], [d["1"], d["2"], d["3"], d["4"], d["5"]],
                                       [eos, pad, pad, pad, pad]]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0, 0], [1] * 5, [1, 0, 0, 0, 0]]  # EOS is a real token
    assert batch.ended.tolist() == [True, False, True]
    assert (batch.behav_logprobs[~batch.response_mask.bool()] == 0).all()
    assert (batch.policy_version == 3).all()
    # position ids: cumsum(mask) - 1 over the left-padded prompt, then one more per step
    assert lm.seen_positions[0].tolist() == [[0, 0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 4]]
    assert lm.seen_positions[1].tolist() == [[5], [7], [5]]
    assert pt.decode_completions(tokenizer, batch) == ["4", "12345", ""]


def test_generate_exits_early_when_every_row_has_ended(tokenizer):
    eos = tokenizer.eos_token_id
    lm = ScriptedLM([[eos] * 16, [eos] * 16], len(tokenizer))
    ids, mask = pt.left_pad([[1, 5], [1, 6]], tokenizer.pad_token_id, "cpu")
    batch = pt.generate(lm, ids, mask, max_new_tokens=16, temperature=1.0, stop_ids=eos, pad_id=tokenizer.pad_token_id,
                        generator=torch.Generator())
    assert batch.response.shape[1] == 4 and lm.calls == 4  # checked every 4 steps, not after all 16


def test_sampling_draws_torch_multinomials_tokens_bit_for_bit():
    for seed, (B, V) in enumerate([(64, 37), (5, 1000), (1, 2)]):
        logits = torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 4
        logits[:, : V // 3] = float("-inf")  # zero-probability ids, as after top-k / top-p
        probs = torch.softmax(logits, -1)
        for draw in range(3):
            expected = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(draw)).squeeze(1)
            assert torch.equal(pt.sample_tokens(probs, torch.Generator().manual_seed(draw)), expected)


def test_every_stop_id_of_the_generation_config_ends_a_row(tokenizer):
    import copy
    from transformers import GenerationConfig
    tok, eos, pad = copy.deepcopy(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id
    eot, d = tok.convert_tokens_to_ids("+"), {c: tok.convert_tokens_to_ids(c) for c in "0123456789"}
    model = tiny_llama(len(tok), dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=[eot, eos])  # a chat model's end-of-turn and EOS
    stop_ids = pt.stop_token_ids(tok, model)
    assert stop_ids == sorted([eot, eos])
    lm = ScriptedLM([[d["4"], eot, d["1"], d["1"]], [d["1"], eos, d["5"], d["5"]], [d["1"]] * 4], len(tok))
    ids, mask = pt.left_pad([[1, 5], [1, 6], [1, 7]], pad, "cpu")
    batch = pt.generate(lm, ids, mask, max_new_tokens=4, temperature=1.0, stop_ids=stop_ids, pad_id=pad,
                        generator=torch.Generator())
    assert batch.response.tolist() == [[d["4"], eot, pad, pad], [d["1"], eos, pad, pad], [d["1"]] * 4]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1] * 4]  # the stop token is real
    assert batch.ended.tolist() == [True, True, False]  # so no missing-EOS penalty for the first two
    assert pt.decode_completions(tok, batch) == ["4", "1", "1111"]  # the text ends before the stop token
    rewards = pt.per_token_rewards(torch.ones(3), torch.zeros(3, 4), batch.response_mask, 0.0)
    assert rewards.tolist() == [[0, 1, 0, 0], [0, 1, 0, 0], [0, 0, 0, 1]]  # the score lands on the stop token
    tok.pad_token = "+"  # a pad that is a stop id (Qwen's <|endoftext|>) is replaced by one of our own
    pt.ensure_pad_token(tok, model, stop_ids)
    assert tok.pad_token == pt.PAD_TOKEN and tok.pad_token_id not in stop_ids


def test_a_runs_completions_end_at_every_stop_id_of_its_model(tmp_path, tokenizer, monkeypatch):
    """The wiring from setup to the sampler (the test above checks generate itself): a model whose generation_config
    makes '+' an end of turn, and its likeliest token; no completion a reward reads may hold one."""
    from transformers import GenerationConfig
    plus, model = tokenizer.convert_tokens_to_ids("+"), tiny_llama(len(tokenizer), dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=[plus, tokenizer.eos_token_id])
    ids = torch.tensor([tokenizer("12+34=", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state.mean((0, 1))
        model.lm_head.weight[plus] = 5 * hidden / hidden.square().sum()  # (its logit: 5 above the others' ~0)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    (tmp_path / "p.jsonl").write_text("".join(f'{{"prompt": "{a}+{a}="}}\n' for a in range(16)))
    (tmp_path / "seen.py").write_text("texts = []\ndef score(prompts, completions):\n    texts.extend(completions)\n"
                                      "    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    cfg = pt.parse_config([*TINY, "--model", str(tmp_path / "m"), "--prompts", "p.jsonl", "--no-chat-template",
                           "--reward", "seen:score", "--response-length", "6", "--steps", "1", "--output-dir", "run"])
    os.makedirs(cfg.output_dir)
    pt.train(cfg, pt.setup(cfg), cfg.output_dir)
    texts = sys.modules["seen"].texts
    assert len(texts) == 16 and not any("+" in t for t in texts) and texts.count("") > 4, texts


def test_pad_token_is_added_when_missing_or_equal_to_eos(tokenizer):
    import copy
    tok = copy.deepcopy(tokenizer)
    tok.pad_token = tok.eos_token  # the common pad = EOS set-up
    model = tiny_llama(len(tok), dtype=torch.float32)
    n_rows = model.get_input_embeddings().weight.shape[0]
    pt.ensure_pad_token(tok, model)
    assert tok.pad_token_id not in (None, tok.eos_token_id)
    assert model.get_input_embeddings().weight.shape[0] == max(n_rows, len(tok)) > tok.pad_token_id
    # and the real EOS of a completion stays in the mask while pads after it do not
    eos = tok.eos_token_id
    lm = ScriptedLM([[eos, 5, 5]], len(tok))
    ids, mask = pt.left_pad([[1, 5]], tok.pad_token_id, "cpu")
    batch = pt.generate(lm, ids, mask, max_new_tokens=3, temperature=1.0, stop_ids=eos, pad_id=tok.pad_token_id,
                        generator=torch.Generator())
    assert batch.response_mask.tolist() == [[1, 0, 0]] and batch.response[0, 1] == tok.pad_token_id != eos


def test_our_added_pad_token_is_never_sampled_and_scoring_agrees(tokenizer):
    import copy
    tok = copy.deepcopy(tokenizer)
    tok.pad_token = tok.eos_token  # no pad of its own: ensure_pad_token adds one, a new id past the vocabulary
    policy = tiny_llama(len(tok), seed=3)
    vocab = pt.ensure_pad_token(tok, policy)
    assert vocab == len(tokenizer) == tok.pad_token_id < policy.lm_head.weight.shape[0]
    ids, mask = pt.left_pad(pt.format_prompts(tok, ["1+2=", "37+45=", "9+90="], False, 64), tok.pad_token_id, "cpu")
    with torch.no_grad():  # make the new row's logit dominate: unmasked, the pad would be sampled nearly always
        hidden = policy.model(input_ids=ids).last_hidden_state.mean((0, 1))
        policy.lm_head.weight[tok.pad_token_id] = 20 * hidden / hidden.square().sum()
    kwargs = dict(max_new_tokens=6, temperature=1.0, stop_ids=tok.eos_token_id, pad_id=tok.pad_token_id)
    unmasked = pt.generate(policy, ids, mask, **kwargs, generator=torch.Generator().manual_seed(0))
    assert (unmasked.response[unmasked.response_mask.bool()] == tok.pad_token_id).any()  # the test can fail
    batch = pt.generate(policy, ids, mask, **kwargs, vocab=vocab, generator=torch.Generator().manual_seed(0))
    assert (batch.response[batch.response_mask.bool()] < vocab).all()
    scored, _ = pt.sequence_logprobs(policy, *pt.full_sequence(batch), batch.response, batch.response_mask, 1.0,
                                     vocab=vocab)  # sampler and scorer: the same distribution over ids < vocab
    torch.testing.assert_close(scored, batch.behav_logprobs, rtol=0, atol=1e-9)
    full, _ = pt.sequence_logprobs(policy, *pt.full_sequence(batch), batch.response, batch.response_mask, 1.0,
                                   full_logits=True, vocab=vocab)
    torch.testing.assert_close(full, scored, rtol=0, atol=1e-9)
    assert pt.full_sequence(batch)[0].max() < vocab  # no model ever reads our pad id (a reward model lacks its row)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.5, 0, 1.0), (0.7, 8, 0.8), (1.3, 0, 0.6)])
def test_tokens_are_drawn_from_the_distribution_hf_defines(temperature, top_k, top_p):
    """The draws themselves (the tests above check their recorded log-probs): 200k rows of one step over fixed logits
    sample Hugging Face's warpers' distribution (the temperature, then top-k, then top-p) within sampling noise."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    V, n = 24, 200_000
    logits = torch.linspace(-2.0, 3.0, V)[torch.randperm(V, generator=torch.Generator().manual_seed(0))]

    class Fixed:  # a decoder whose every step gives these logits
        def start(self, ids, mask, position_ids):
            return logits.expand(len(ids), V)
    warpers = [TemperatureLogitsWarper(temperature), *([TopKLogitsWarper(top_k)] if top_k else []),
               *([TopPLogitsWarper(top_p)] if top_p < 1 else [])]
    expected = logits[None].clone()
    for warp in warpers:
        expected = warp(None, expected)
    expected = torch.softmax(expected, -1)[0]  # (V,)
    ids = torch.zeros(n, 1, dtype=torch.long)
    batch = pt.generate(Fixed(), ids, torch.ones_like(ids), max_new_tokens=1, temperature=temperature, stop_ids=[V],
                        pad_id=V + 1, generator=torch.Generator().manual_seed(1), top_k=top_k, top_p=top_p)
    seen = torch.bincount(batch.response[:, 0], minlength=V).double() / n
    assert 0.5 * (seen - expected).abs().sum() < 0.01  # total variation (noise: <= 0.003; without the temperature, or
    # with it after top-p: 0.1-0.25)
    torch.testing.assert_close(batch.behav_logprobs[:, 0].exp(), expected[batch.response[:, 0]])  # and its log-prob


@pytest.mark.parametrize("temperature,top_k,top_p,full_logits", [(1.0, 0, 1.0, False), (0.7, 0, 1.0, True),
                                                                 (0.7, 0, 1.0, False), (1.3, 5, 1.0, False),
                                                                 (1.0, 0, 0.8, True)])
def test_behaviour_logprobs_equal_recomputed_logprobs(tokenizer, temperature, top_k, top_p, full_logits):
    policy = tiny_llama(len(tokenizer), seed=2)
    texts = ["1+2=", "37+45=", "9+90=", "5+5="]
    batch = demo_rollout(tokenizer, policy, texts, temperature, top_k, top_p, T=6)
    logprobs, entropy = pt.sequence_logprobs(policy, *pt.full_sequence(batch), batch.response, batch.response_mask,
                                             temperature, batch.kept_ids, full_logits)
    # same weights, same temperature, same positions: only KV-cache vs full-forward rounding (float64) differs
    torch.testing.assert_close(logprobs.double(), batch.behav_logprobs.double(), rtol=0, atol=1e-9)
    assert (logprobs[~batch.response_mask.bool()] == 0).all()
    if top_k == 0 and top_p == 1.0:  # a different temperature when scoring would not match: the test can fail
        wrong, _ = pt.sequence_logprobs(policy, *pt.full_sequence(batch), batch.response, batch.response_mask,
                                        temperature + 0.5)
        assert (wrong - logprobs).abs().max() > 1e-3
    if top_k or top_p < 1:  # kept-set renormalisation: kept ids recorded, log-probs >= the full-vocab ones
        assert batch.kept_ids.shape[:2] == batch.response.shape
        full, _ = pt.sequence_logprobs(policy, *pt.full_sequence(batch), batch.response, batch.response_mask,
                                       temperature)
        assert (logprobs >= full - 1e-9).all() and (logprobs > full + 1e-6).any()


def tiny_gpt2(vocab_size, seed=0):  # absolute position embeddings: wrong position ids change every logit
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)
    return GPT2LMHeadModel(config).double().eval()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_left_padding_gives_the_same_logprobs_as_no_padding(tokenizer, family):
    policy = (tiny_llama if family == "llama" else tiny_gpt2)(len(tokenizer), seed=3)
    prompt = pt.format_prompts(tokenizer, ["12+34="], False, 64)[0]
    response = torch.tensor([[tokenizer.convert_tokens_to_ids("4"), tokenizer.convert_tokens_to_ids("6"),
                              tokenizer.eos_token_id]])
    results = []
    for n_pad in (0, 5):
        ids, mask = pt.left_pad([prompt, [1] * (len(prompt) + n_pad)], tokenizer.pad_token_id, "cpu")
        batch = pt.Rollout(ids[:1], mask[:1], response, torch.ones_like(response), None, None, None)
        results.append(pt.sequence_logprobs(policy, *pt.full_sequence(batch), response, batch.response_mask, 1.0)[0])
        if n_pad and family == "gpt2":  # naive positions 0..L-1 count the pads: wrong (RoPE is shift-invariant, so
            ids_, mask_, _ = pt.full_sequence(batch)  # a Llama would not notice; absolute positions do)
            naive = torch.arange(ids_.shape[1])[None]
            wrong = pt.sequence_logprobs(policy, ids_, mask_, naive, response, batch.response_mask, 1.0)[0]
            assert (wrong - results[0]).abs().max() > 1e-4
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-10)


def test_behaviour_logprobs_equal_recomputed_logprobs_gpt2(tokenizer):
    policy = tiny_gpt2(len(tokenizer), seed=2)
    batch = demo_rollout(tokenizer, policy, ["1+2=", "37+45=", "9+90="], 0.8, T=6)
    logprobs, _ = pt.sequence_logprobs(policy, *pt.full_sequence(batch), batch.response, batch.response_mask, 0.8)
    torch.testing.assert_close(logprobs.double(), batch.behav_logprobs.double(), rtol=0, atol=1e-9)


# ---------------------------------------------------------------------------------------------------------------
# scoring: sequence log-probs, the fused head check, packed scoring == padded scoring, reward model scores


def test_fused_head_is_checked_against_the_models_own_logits(tokenizer):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    policy = tiny_llama(len(tokenizer), dtype=torch.float32)
    assert pt.fused_head_agrees(policy)
    head = policy.lm_head  # a model that scales its logits in its own code (as Falcon-H1's lm_head_multiplier)
    policy.lm_head = torch.nn.Linear(32, len(tokenizer), bias=False)
    policy.lm_head.weight = head.weight
    policy.lm_head.forward = lambda h: torch.nn.functional.linear(h, head.weight) * 0.5
    assert not pt.fused_head_agrees(policy)
    torch.manual_seed(0)
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           intermediate_size=64, final_logit_softcapping=0.5)).eval()
    assert not pt.fused_head_agrees(gemma)  # softcapping
    gemma.config.final_logit_softcapping = 30.0  # a real model's cap: the random model's logits never reach it
    assert not pt.fused_head_agrees(gemma)


def make_kept(tokens, vocab, k, drop_sampled=()):
    """Distinct kept ids per row with the sampled token among them (except rows in drop_sampled), -1 padded."""
    n = tokens.shape[0]
    kept = torch.full((n, k), -1, dtype=torch.long)
    for i in range(n):
        size = int(torch.randint(2, k + 1, ()))
        ids = torch.randperm(vocab)[:size]
        tok = int(tokens[i]) % vocab
        ids = ids[ids != tok][: size - 1]
        ids = ids if i in drop_sampled else torch.cat([ids, torch.tensor([tok])])
        kept[i, :ids.numel()] = ids[torch.randperm(ids.numel())]
    return kept


def ragged_batch(tokenizer, n=7, T=6, seed=0):  # prompts of 3..12 tokens, responses of 1..T tokens
    g = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(3, 13, (n,), generator=g)
    prompts = [torch.randint(5, len(tokenizer), (int(k),), generator=g).tolist() for k in prompt_lengths]
    ids, mask = pt.left_pad(prompts, tokenizer.pad_token_id, "cpu")
    lengths = torch.cat([torch.tensor([1, T]), torch.randint(1, T + 1, (n - 2,), generator=g)])  # a length-1 response
    response_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    tokens = torch.randint(5, len(tokenizer), (n, T), generator=g)
    response = torch.where(response_mask.bool(), tokens, tokenizer.pad_token_id)
    return pt.Rollout(ids, mask, response, response_mask, None, None, None)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_packed_scoring_equals_padded_scoring(tokenizer, family):
    policy = (tiny_llama if family == "llama" else tiny_gpt2)(len(tokenizer), seed=3)  # float64
    padded_critic = pt.build_critic(policy)
    torch.nn.init.normal_(padded_critic.head.weight)  # a non-zero value head
    batch = ragged_batch(tokenizer)
    batch.kept_ids = make_kept(batch.response.reshape(-1), len(tokenizer), 5).view(*batch.response.shape, 5)  # top-k
    padded = pt.sequence_logprobs(policy, *pt.full_sequence(batch), batch.response, batch.response_mask, 0.8,
                                  batch.kept_ids)
    padded_values = pt.critic_values(padded_critic, batch)
    kernels.use_ppo_attention(pt.backbone_of(policy))  # (float64: use_packed_attention's bf16 noise would be 0)
    critic = pt.build_critic(policy)
    critic.head.weight.data.copy_(padded_critic.head.weight)
    *inputs, layout = pt.packed_inputs(batch)
    assert inputs[0].shape[1] == int(batch.prompt_mask.sum() + batch.response_mask.sum())  # no pads at all
    packed = pt.sequence_logprobs(policy, *inputs, batch.response, batch.response_mask, 0.8, batch.kept_ids,
                                  layout=layout)
    for a, b in zip(packed, padded):  # log-probs and entropies; float64, so only summation order differs
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
        assert (a[~batch.response_mask.bool()] == 0).all()
    # the critic is float32 (build_critic): float32 rounding
    packed_values = pt.critic_values(critic, batch, pt.packed_inputs(batch))
    torch.testing.assert_close(packed_values, padded_values, rtol=0, atol=1e-5)
    cfg = SimpleNamespace(temperature=0.8, full_logits=True, micro_batch_tokens=64)  # the full-logits path packs too
    torch.testing.assert_close(pt.rollout_logprobs(policy, batch, cfg)[0], padded[0], rtol=0, atol=1e-10)
    from transformers import MistralConfig, MistralForCausalLM  # sliding windows are refused, not silently ignored
    sliding = MistralForCausalLM(MistralConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, sliding_window=3))
    assert "MistralModel cannot run packed (sliding-window" in pt.use_packed_attention(pt.backbone_of(sliding))


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # gpt2: absolute positions, which left padding must not shift
def test_reward_model_scores_at_last_token_with_same_or_different_tokenizer(tokenizer, family):
    import copy
    backbone = tiny_llama(len(tokenizer) + 1, seed=7, dtype=torch.float32).model if family == "llama" else \
        tiny_gpt2(len(tokenizer) + 1, seed=7).float().transformer
    rm = pt.ScalarHeadModel(backbone, torch.nn.Linear(32, 1, bias=False)).eval()
    texts, answers = ["1+2=", "37+45=", "9+90="], ["3", "82", ""]
    ids, mask = pt.left_pad(pt.format_prompts(tokenizer, texts, False, 64), tokenizer.pad_token_id, "cpu")
    targets = [tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for a in answers]
    response = tokenizer.pad({"input_ids": targets}, padding_side="right", return_tensors="pt")
    batch = pt.Rollout(ids, mask, response["input_ids"], response["attention_mask"], None, None, None)
    batch.ended, batch.prompts, batch.completions = torch.ones(3, dtype=torch.bool), texts, answers
    same = pt.reward_model_scores(rm, tokenizer, tokenizer, batch, False, 2)
    other = copy.deepcopy(tokenizer)
    other.add_special_tokens({"additional_special_tokens": ["<extra>"]})  # another vocabulary: decode + re-tokenize
    retokenized = pt.reward_model_scores(rm, other, tokenizer, batch, False, 2)
    # the re-tokenized text gets the EOS back, so both read the score at the EOS
    n_real = batch.response_mask.sum(-1)
    ids, mask, pos = pt.full_sequence(batch)
    P = batch.prompt_ids.shape[1]
    expected = torch.stack([rm(ids[i:i + 1], mask[i:i + 1], pos[i:i + 1])[0, P + n_real[i] - 1] for i in range(3)])
    torch.testing.assert_close(retokenized, expected, rtol=1e-5, atol=1e-5)
    last = batch.response_mask.sum(-1) + P - 1
    torch.testing.assert_close(same, torch.stack([rm(ids[i:i + 1], mask[i:i + 1], pos[i:i + 1])[0, last[i]]
                                                  for i in range(3)]), rtol=1e-5, atol=1e-5)
    # a chat template: a truncated completion stays an open assistant turn (no end-of-turn), a finished one is closed
    other.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{% if m['role'] == 'assistant' "
                           "%}<eos>{% endif %}{% endfor %}")
    texts, render = [], other.apply_chat_template

    def recorded(*args, **kwargs):  # the texts the reward model is given
        texts.append(render(*args, **kwargs))
        return texts[-1]

    other.apply_chat_template = recorded
    batch.ended = torch.tensor([True, False, True])
    pt.reward_model_scores(rm, other, tokenizer, batch, True, 2)
    assert texts == ["u:1+2=a:3<eos>", "u:37+45=a:82", "u:9+90=a:<eos>"]
    # a template that rewrites the turn (as those that drop a <think> part): it cannot stay open, so it is closed,
    # not a crash
    other.chat_template = other.chat_template.replace("m['content']", "m['content'][1:]")
    texts.clear()
    pt.reward_model_scores(rm, other, tokenizer, batch, True, 2)
    assert texts[-2:] == ["u:7+45=a:2<eos>", "u:+90=a:<eos>"]


# ---------------------------------------------------------------------------------------------------------------
# advantages: GAE, per-token rewards and the KL in them, KL estimators, whitening, the missing-EOS penalty,
# the off-policy correction (importance weights): against hand-computed values and textbook formulas


def test_gae_and_returns_match_hand_computed_example():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.0, 99.0]], dtype=torch.float64)  # 99: garbage on a pad
    values = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 77.0]], dtype=torch.float64)  # 77: garbage on a pad
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = pt.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # by hand, gamma*lam = 0.72. Row 0: d2 = 1 - .3 = .7; d1 = .9*.3 - .2 = .07; d0 = .9*.2 - .1 = .08
    #   A2 = .7, A1 = .07 + .72*.7 = .574, A0 = .08 + .72*.574 = .49328
    # Row 1 ends at t=1, so V_2 counts as 0: d1 = -.5, d0 = .5 + .9*.5 - .4 = .55; A1 = -.5, A0 = .55 - .72*.5 = .19
    expected_adv = torch.tensor([[0.49328, 0.574, 0.7], [0.19, -0.5, 0.0]], dtype=torch.float64)
    expected_ret = torch.tensor([[0.59328, 0.774, 1.0], [0.59, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, expected_ret, rtol=0, atol=1e-12)


def test_reward_lands_on_last_real_token_never_on_pad():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    kl = torch.rand(3, 4, dtype=torch.float64)
    scores = torch.tensor([2.0, 3.0, -1.0], dtype=torch.float64)
    rewards = pt.per_token_rewards(scores, kl, mask, kl_coef=0.1)
    expected = torch.where(mask.bool(), -0.1 * kl, 0.0)
    expected[0, 1] += 2.0
    expected[1, 3] += 3.0
    expected[2, 0] += -1.0
    torch.testing.assert_close(rewards, expected, rtol=0, atol=1e-12)
    assert (rewards[~mask.bool()] == 0).all()


def test_multi_turn_rewards_land_on_each_turns_last_policy_token():
    # a hand-built conversation: turn 1 (columns 0-1), an observation (2-3), turn 2 (4-5), pads (6)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0]])  # row 1: one turn
    turns = torch.zeros(2, 7, dtype=torch.float64)
    turns[0, 1], turns[0, 5], turns[1, 2] = 0.25, 1.0, 0.5  # each turn's reward on its last policy token
    kl = torch.rand(2, 7, dtype=torch.float64)
    scores = turns.sum(-1) - torch.tensor([2.0, 1.0])  # the missing-EOS penalty on the episode's return
    rewards = pt.per_token_rewards(scores, kl, mask, 0.1, turns)
    expected = torch.where(mask.bool(), -0.1 * kl, 0.0)
    expected[0, 1] += 0.25
    expected[0, 5] += 1.0 - 2.0  # (the last policy token: not column 3, an observation's, nor the mask's count - 1)
    expected[1, 2] += 0.5 - 1.0
    torch.testing.assert_close(rewards, expected, rtol=0, atol=1e-12)
    assert (rewards[~mask.bool()] == 0).all()  # never on an observation or a pad


def test_gae_steps_over_observations_as_one_trajectory_against_a_float64_loop():
    torch.manual_seed(0)
    B, T, gamma, lam = 5, 11, 0.9, 0.8
    mask = (torch.rand(B, T) < 0.6).long()  # holes: observation tokens between the policy's
    mask[:, 0], mask[0] = 1, 1  # (a response starts with the policy's token; row 0: one turn, no hole)
    rewards, values = torch.randn(B, T, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    adv, ret = pt.gae(rewards, values, mask, gamma, lam)
    for b in range(B):  # the recursion over the policy's tokens alone: V after the last one is 0
        cols = mask[b].nonzero()[:, 0].tolist()
        a, expected = 0.0, torch.zeros(T, dtype=torch.float64)
        for i in reversed(range(len(cols))):
            nxt = float(values[b, cols[i + 1]]) if i + 1 < len(cols) else 0.0
            a = float(rewards[b, cols[i]]) + gamma * nxt - float(values[b, cols[i]]) + gamma * lam * a
            expected[cols[i]] = a
        torch.testing.assert_close(adv[b], expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(ret[b], torch.where(mask[b].bool(), expected + values[b], 0.0), rtol=0, atol=1e-12)


def test_kl_estimators_formulas_and_unbiasedness():
    logp = torch.randn(1000, dtype=torch.float64)
    ref = torch.randn(1000, dtype=torch.float64)
    torch.testing.assert_close(pt.kl_estimate(logp, ref, "k1"), logp - ref)
    torch.testing.assert_close(pt.kl_estimate(logp, ref, "k3"), torch.exp(ref - logp) - (ref - logp) - 1)
    assert (pt.kl_estimate(logp, ref, "k3") >= 0).all()
    # both are unbiased estimators of KL(p || q) on samples from p
    p = torch.softmax(torch.randn(6, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(6, dtype=torch.float64), 0)
    true_kl = float((p * (p / q).log()).sum())
    x = torch.multinomial(p, 400_000, replacement=True)
    for k in ("k1", "k3"):
        estimate = float(pt.kl_estimate(p.log()[x], q.log()[x], k).mean())
        assert abs(estimate - true_kl) < 0.02 + 0.05 * true_kl, (k, estimate, true_kl)


def test_advantage_whitening_uses_real_tokens_only():
    x = torch.randn(4, 6, dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    out = pt.masked_whiten(x, mask)
    garbage = torch.where(mask.bool(), x, torch.full_like(x, 1e6))
    torch.testing.assert_close(pt.masked_whiten(garbage, mask), out)  # pads change nothing
    real = out[mask.bool()]
    assert abs(float(real.mean())) < 1e-12 and abs(float(real.std()) - 1) < 1e-6  # unbiased std over real tokens
    assert (out[~mask.bool()] == 0).all()


def test_gae_advantages_are_whitened_over_the_real_tokens_only_and_the_returns_are_not():
    g = torch.Generator().manual_seed(7)
    mask = (torch.arange(6)[None] < torch.tensor([6, 2, 4, 1])[:, None]).long()  # (4, 6), pads at the ends
    rewards, values = (torch.where(mask.bool(), torch.randn(4, 6, dtype=torch.float64, generator=g), 0.0)
                       for _ in range(2))
    advantages, returns = pt.ADVANTAGES["gae"].fn(SimpleNamespace(rewards=rewards, values=values, response_mask=mask),
                                                  pt.Config())
    raw, raw_returns = pt.gae(rewards, values, mask, 1.0, 0.95)
    real, raw = advantages[mask.bool()], raw[mask.bool()]
    torch.testing.assert_close(real, (raw - raw.mean()) / raw.std(), rtol=0, atol=1e-6)  # (unbiased, real tokens)
    assert (advantages[~mask.bool()] == 0).all() and torch.equal(returns, raw_returns)  # the critic's targets: raw


def score_frozen(batch, reference, reward_fn, cfg):  # what make_batch does after sampling: the reward, then the rest
    pt.reward_scores(batch, reward_fn, cfg)
    pt.score_frozen(batch, reference, cfg)


def tiny_setup(tokenizer, **cfg_overrides):
    cfg = pt.Config(**{"batch_size": 8, "minibatches": 2, "ppo_epochs": 2, "response_length": 4, **cfg_overrides})
    pt.check_config(cfg)
    policy = tiny_llama(len(tokenizer), seed=4, dtype=torch.float32)
    pt.disable_dropout(policy)
    reference = tiny_llama(len(tokenizer), seed=5, dtype=torch.float32).requires_grad_(False)
    critic = pt.build_critic(policy)
    texts = [f"{a}+{b}=" for a, b in [(1, 2), (37, 45), (9, 90), (5, 5), (12, 3), (0, 0), (99, 99), (50, 7)]]
    batch = demo_rollout(tokenizer, policy, texts, cfg.temperature, T=cfg.response_length)
    return cfg, policy, reference, critic, batch


def score(batch, policy, reference, critic, reward_fn, cfg, row_order=None):
    score_frozen(batch, reference, reward_fn, cfg)
    return pt.score_trainer(batch, policy, critic, cfg, row_order)


def constant_reward(value):
    return lambda b: torch.full((b.response.shape[0],), float(value))


def test_kl_in_the_reward_and_identical_reference_gives_zero_kl(tokenizer):
    cfg, policy, _, critic, batch = tiny_setup(tokenizer, kl_coef=0.1)
    kl = score(batch, policy, policy, critic, constant_reward(0.0), cfg)
    assert float(kl.abs().max()) == 0.0  # reference == policy: no penalty
    cfg, policy, reference, critic, batch = tiny_setup(tokenizer, kl_coef=0.1, kl_estimator="k3")
    kl = score(batch, policy, reference, critic, constant_reward(0.0), cfg)
    k3 = pt.kl_estimate(batch.old_logprobs, batch.ref_logprobs, "k3")
    expected = torch.where(batch.response_mask.bool(), -0.1 * k3, 0.0)
    torch.testing.assert_close(batch.rewards, expected)
    assert (kl >= 0).all() and float(kl.max()) > 0


def test_long_prompts_keep_their_last_tokens_with_a_warning(tokenizer, capsys):
    ids = pt.format_prompts(tokenizer, ["12+34=", "1+2="], False, 5)
    assert ids == [tokenizer("12+34=")["input_ids"][-5:], tokenizer("1+2=")["input_ids"]]
    assert "1 of 2 prompts are longer than --max-prompt-length 5 tokens" in capsys.readouterr().out


def test_missing_eos_penalty(tokenizer):
    cfg, policy, reference, critic, batch = tiny_setup(tokenizer, missing_eos_penalty=0.5)
    batch.ended = torch.tensor([True, False] * 4)
    score(batch, policy, reference, critic, constant_reward(1.0), cfg)
    assert batch.scores.tolist() == [1.0, 0.5] * 4


def test_importance_weights_are_exactly_one_for_fresh_tokens_and_truncated_for_stale_ones(tokenizer):
    cfg, policy, reference, critic, batch = tiny_setup(tokenizer, is_cap=1.5)
    batch.policy_version = torch.tensor([[5], [4], [3], [5], [4], [3], [5], [5]]).expand_as(batch.response).clone()
    batch.behav_logprobs = batch.behav_logprobs + 0.3 * torch.randn_like(batch.behav_logprobs)  # stale behaviour
    score_frozen(batch, reference, constant_reward(1.0), cfg)
    pt.score_trainer(batch, policy, critic, cfg, version=5)
    mask, age = batch.response_mask.bool(), 5 - batch.policy_version
    assert (batch.is_weight[mask & (age == 0)] == 1.0).all()  # exactly 1, though behav != prox numerically
    expected = torch.exp(batch.old_logprobs - batch.behav_logprobs).clamp(max=cfg.is_cap)
    torch.testing.assert_close(batch.is_weight[mask & (age > 0)], expected[mask & (age > 0)])
    assert (batch.is_weight[mask & (age > 0)] == cfg.is_cap).any()  # some capped
    assert torch.equal(batch.loss_mask.bool(), mask) and batch.correction["tokens_dropped"] == 0
    assert batch.correction["staleness_max"] == 2


def test_per_token_rewards_land_on_their_tokens_and_the_readmes_overlong_penalty_is_dapos(tokenizer):
    """A reward function may return, per completion, a reward per token (a process reward): each lands on its token
    among the per-token rewards, with the KL and the missing-EOS penalty (against a float64 loop); the group
    estimators see the sum. The README's DAPO overlong penalty, run as written there, is DAPO's length penalty."""
    def process(prompts, completions, completion_ids):  # row r, token i: (i + 1) / 4, the sign alternating by row
        return [[(-1) ** r * (i + 1) / 4 for i in range(len(ids))] for r, ids in enumerate(completion_ids)]

    cfg, policy, reference, critic, batch = tiny_setup(tokenizer, kl_coef=0.1, missing_eos_penalty=0.5)
    kl = score(batch, policy, reference, critic, functools.partial(pt.rule_scores, process), cfg)
    lengths, ended = batch.response_mask.sum(1).tolist(), batch.ended.tolist()
    assert not all(ended) and any(ended) and min(lengths) >= 2  # (both kinds of row, with tokens to reward)
    for b, (n, stop) in enumerate(zip(lengths, ended)):
        for t in range(batch.response.shape[1]):
            want = -0.1 * float(kl[b, t]) if t < n else 0.0
            want += (-1) ** b * (t + 1) / 4 if t < n - stop else 0.0  # on the completion's tokens, not the stop token
            want -= 0.5 if t == n - 1 and not stop else 0.0  # the missing-EOS penalty on the last real token
            assert abs(float(batch.rewards[b, t]) - want) < 1e-6, (b, t)
        assert abs(float(batch.raw_scores[b]) - (-1) ** b * (n - stop) * (n - stop + 1) / 8) < 1e-6
    grouped, policy, reference, _, batch = tiny_setup(tokenizer, advantage="grpo", samples_per_prompt=4)
    score(batch, policy, reference, None, functools.partial(pt.rule_scores, process), grouped)
    expected = group_estimate(batch.raw_scores, 4, "grpo")  # each completion's advantage: from its rewards' sum
    assert torch.equal(batch.advantages, torch.where(batch.response_mask.bool(), expected[:, None], 0.0))
    with pytest.raises(SystemExit, match="returned 1 rewards for completion 0, which has"):
        pt.rule_scores(lambda prompts, completions: [[1.0]] * len(completions), batch)

    readme = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    namespace = {}
    exec(re.search(r"```python\n(def overlong\(.*?)```", readme, re.S).group(1), namespace)
    overlong = namespace["overlong"]
    for length in range(0, 257):  # DAPO: 0 up to budget - last, then (budget - last - |y|) / last, -1 at the budget
        total = sum(overlong([""], [""], [[7] * length])[0])
        assert abs(total - min(0.0, (192 - length) / 64)) < 1e-9, length
    tokens = pt.rule_scores(functools.partial(overlong, budget=4, last=2), batch)  # through the reward contract
    completion = torch.arange(4) < (batch.response_mask.sum(1, keepdim=True) - batch.ended[:, None].long())
    assert torch.equal(batch.token_rewards, torch.where(completion & (torch.arange(4) >= 2), -0.5, 0.0))
    assert torch.equal(tokens, batch.token_rewards.sum(-1))


def group_estimate(scores, n, estimator, scale_rewards="group"):  # (B,) an estimator's advantage of each completion
    batch = SimpleNamespace(rewards=scores[:, None], response_mask=torch.ones(len(scores), 1))  # one token each
    cfg = pt.Config(advantage=estimator, samples_per_prompt=n, scale_rewards=scale_rewards)
    return pt.ADVANTAGES[estimator].fn(batch, cfg)[0][:, 0]


def test_group_advantages_grpo_rloo_and_dr_grpo_against_float64_loops():
    torch.manual_seed(0)
    n, groups = 4, 3
    s = torch.randn(groups * n, dtype=torch.float64)
    s[n:2 * n] = 0.5  # a flat group: every completion scored the same
    grpo, rloo = group_estimate(s, n, "grpo"), group_estimate(s, n, "rloo")
    dr_grpo, batch_scaled = group_estimate(s, n, "grpo", "none"), group_estimate(s, n, "grpo", "batch")
    batch_std = statistics.stdev(s.tolist())
    for g in range(groups):
        x = s[g * n:(g + 1) * n].tolist()
        mean, std = sum(x) / n, statistics.stdev(x)  # the unbiased std, as TRL and verl
        for i in range(n):
            k = g * n + i
            assert abs(float(grpo[k]) - (x[i] - mean) / (std + 1e-6)) < 1e-12
            assert abs(float(rloo[k]) - (x[i] - (sum(x) - x[i]) / (n - 1))) < 1e-12  # minus the others' mean
            assert abs(float(dr_grpo[k]) - (x[i] - mean)) < 1e-12
            assert abs(float(batch_scaled[k]) - (x[i] - mean) / (batch_std + 1e-6)) < 1e-12
    assert (grpo[n:2 * n] == 0).all() and (rloo[n:2 * n] == 0).all()  # a flat group carries no signal
    assert pt.flat_groups(s, n).tolist() == [False] * n + [True] * n + [False] * n


def test_critic_free_scoring_gives_each_token_its_completions_advantage_and_drops_flat_groups(tokenizer):
    cfg, policy, reference, _, batch = tiny_setup(tokenizer, advantage="rloo", samples_per_prompt=4,
                                                  drop_flat_groups=True)
    assert cfg.kl_in == "loss" and cfg.kl_estimator == "k3"  # critic-free defaults: GRPO's KL term
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])  # the second group is flat
    score(batch, policy, reference, None, lambda b: scores, cfg)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(batch.rewards.sum(-1), scores)  # no KL in the rewards
    expected = group_estimate(scores, 4, "rloo")
    assert torch.equal(batch.advantages, torch.where(mask, expected[:, None], 0.0))
    assert batch.returns is None and batch.row_stats["zero_std_groups"] == 1
    assert not batch.loss_mask[4:].any() and torch.equal(batch.loss_mask[:4].bool(), mask[:4])
    cfg, policy, reference, _, batch = tiny_setup(tokenizer, advantage="grpo", samples_per_prompt=4, kl_in="reward")
    score(batch, policy, reference, None, lambda b: scores, cfg)  # a KL in the reward: the flat group's rows differ
    # by their KL alone, which the group's std scales up to full-size advantages (noise): they leave all the same
    assert batch.advantages[4:].abs().max() > 0.1 and not batch.loss_mask[4:].any()
    cfg, policy, reference, _, batch = tiny_setup(tokenizer, advantage="rloo", samples_per_prompt=4,
                                                  missing_eos_penalty=1.0)
    batch.ended[4] = False  # the same raw scores, but one completion without EOS: the penalty is a signal
    score(batch, policy, reference, None, lambda b: scores, cfg)
    assert batch.row_stats["zero_std_groups"] == 0 and torch.equal(batch.loss_mask, batch.response_mask)


def test_mismatch_correction_weights_fresh_tokens_too_and_logs_the_mismatch(tokenizer):
    cfg, policy, reference, critic, batch = tiny_setup(tokenizer, mismatch_correction=True, is_cap=1.5)
    batch.behav_logprobs = batch.behav_logprobs + 0.3 * torch.randn_like(batch.behav_logprobs)  # other numerics
    score_frozen(batch, reference, constant_reward(1.0), cfg)
    pt.score_trainer(batch, policy, critic, cfg, version=0)  # every token fresh (version 0)
    mask = batch.response_mask.bool()
    log_ratio = (batch.old_logprobs - batch.behav_logprobs).double()[mask]
    torch.testing.assert_close(batch.is_weight[mask].double(), log_ratio.exp().clamp(max=1.5))
    c = batch.correction
    assert math.isclose(c["behav_prox_mean_diff"], float(log_ratio.abs().mean()), rel_tol=1e-5)
    assert math.isclose(c["behav_prox_max_diff"], float(log_ratio.abs().max()), rel_tol=1e-5)
    assert math.isclose(c["behav_prox_kl"], float((log_ratio.exp() - 1 - log_ratio).mean()), rel_tol=1e-4)
    assert 0 < c["is_capped_frac"] == pytest.approx(float((log_ratio.exp() > 1.5).double().mean()))
    cfg.mismatch_correction = False
    pt.score_trainer(batch, policy, critic, cfg, version=0)
    assert (batch.is_weight[mask] == 1.0).all()  # without the flag a fresh token's weight is exactly 1


# ---------------------------------------------------------------------------------------------------------------
# the losses: policy loss, value loss, explained variance, loss denominators, the decoupled loss


def objective(logp, old, adv, mask, share=pt.Share(), is_weight=None, **cfg):  # policy_objective
    mb = SimpleNamespace(old_logprobs=old, advantages=adv, loss_mask=mask, is_weight=is_weight)
    return pt.policy_objective(logp, mb, pt.Config(**cfg), share)


@pytest.mark.parametrize("eps_high", [0.0, 0.28])  # 0: --clip-range; 0.28: DAPO's clip-higher
def test_policy_loss_equals_textbook_formula(eps_high):
    torch.manual_seed(0)
    B, T, eps = 5, 7, 0.2
    high = eps_high or eps
    logp = torch.randn(B, T, dtype=torch.float64) * 0.3
    old = logp + torch.randn(B, T, dtype=torch.float64) * 0.3
    adv = torch.randn(B, T, dtype=torch.float64)
    mask = (torch.rand(B, T) > 0.3).long()
    mask[:, 0] = 1
    loss, stats = objective(logp, old, adv, mask, clip_range=eps, clip_range_high=eps_high)
    # textbook (Schulman et al. 2017, eq. 7), element by element: maximise min(r A, clip(r, 1-e, 1+e_high) A)
    terms, clipped, kls = [], [], []
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                r = math.exp(logp[b, t] - old[b, t])
                a = float(adv[b, t])
                terms.append(min(r * a, min(max(r, 1 - eps), 1 + high) * a))
                clipped.append(float(min(max(r, 1 - eps), 1 + high) * a < r * a))
                kls.append((r - 1) - math.log(r))
    assert abs(float(loss) - (-sum(terms) / len(terms))) < 1e-12
    assert abs(float(stats["clipfrac"]) - sum(clipped) / len(clipped)) < 1e-12
    assert abs(float(stats["approx_kl"]) - sum(kls) / len(kls)) < 1e-12
    # a micro-batch's share: sum over its tokens / the minibatch's token count
    share = pt.Share(mask.sum(), mask.sum())
    half_loss, _ = objective(logp[:2], old[:2], adv[:2], mask[:2], share, clip_range=eps, clip_range_high=eps_high)
    rest_loss, _ = objective(logp[2:], old[2:], adv[2:], mask[2:], share, clip_range=eps, clip_range_high=eps_high)
    torch.testing.assert_close(half_loss + rest_loss, loss)


def test_value_loss_is_clipped_textbook_formula():
    torch.manual_seed(1)
    v, old_v, ret = (torch.randn(4, 5, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(4, 5, dtype=torch.long)
    mask[1, 3:] = 0
    c = 0.2
    loss, _ = pt.value_loss(v, old_v, ret, mask, c)
    terms = []
    for b in range(4):
        for t in range(5):
            if mask[b, t]:
                vc = float(old_v[b, t]) + min(max(float(v[b, t] - old_v[b, t]), -c), c)
                terms.append(max((float(v[b, t]) - float(ret[b, t])) ** 2, (vc - float(ret[b, t])) ** 2))
    assert abs(float(loss) - 0.5 * sum(terms) / len(terms)) < 1e-12
    # a prediction far outside the clip range gets no gradient from the clipped branch when that one is worse
    v1 = torch.tensor([[5.0]], dtype=torch.float64, requires_grad=True)
    l1, _ = pt.value_loss(v1, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([[10.0]], dtype=torch.float64),
                          torch.ones(1, 1), c)
    l1.backward()
    assert float(v1.grad) == 0.0 and abs(float(l1.detach()) - 0.5 * (10 - 0.2) ** 2) < 1e-12


def test_explained_variance():
    ret = torch.randn(3, 4, dtype=torch.float64)
    mask = torch.ones(3, 4)
    assert abs(float(pt.explained_variance(ret, ret, mask)) - 1.0) < 1e-12
    assert abs(float(pt.explained_variance(torch.full_like(ret, float(ret.mean())), ret, mask))) < 1e-12


def test_a_given_loss_denominator_is_not_clamped():
    x, mask = torch.tensor([1.0, 2.0, 99.0]), torch.tensor([1, 1, 0])
    assert float(pt.masked_mean(x, mask)) == 1.5 and float(pt.masked_mean(x, torch.zeros(3))) == 0.0
    # one real token over 2 ranks: each rank divides its sum by 1 / 2 (clamping that to 1 halved the gradient)
    assert float(pt.masked_mean(x, mask, torch.tensor(0.5))) == 6.0


def test_decoupled_loss_with_fresh_tokens_is_standard_ppo_to_the_bit():
    logp, old, adv = (torch.randn(3, 5) for _ in range(3))
    mask = torch.ones(3, 5)
    standard, _ = objective(logp, old, adv, mask)
    decoupled, _ = objective(logp, old, adv, mask, is_weight=torch.ones(3, 5))
    assert torch.equal(standard, decoupled)
    half, _ = objective(logp, old, adv, mask, is_weight=torch.full((3, 5), 0.5))
    torch.testing.assert_close(half, standard / 2)


def test_k2_is_half_the_squared_log_ratio_and_its_expected_gradient_is_the_kls():
    logp, ref = torch.randn(1000, dtype=torch.float64), torch.randn(1000, dtype=torch.float64)
    torch.testing.assert_close(pt.kl_estimate(logp, ref, "k2"), 0.5 * (logp - ref) ** 2)
    # exactly, for a categorical policy p_theta: E_{x~p}[grad k2(x)] = grad KL(p || q); E[grad k1(x)] = 0
    theta = torch.randn(6, dtype=torch.float64, requires_grad=True)
    q = torch.softmax(torch.randn(6, dtype=torch.float64), 0)
    logp_all = torch.log_softmax(theta, 0)
    p = logp_all.exp().detach()  # the sampling distribution: no gradient through it
    (grad_kl,) = torch.autograd.grad((logp_all.exp() * (logp_all - q.log())).sum(), theta, retain_graph=True)
    (grad_k2,) = torch.autograd.grad((p * pt.kl_estimate(logp_all, q.log(), "k2")).sum(), theta, retain_graph=True)
    (grad_k1,) = torch.autograd.grad((p * pt.kl_estimate(logp_all, q.log(), "k1")).sum(), theta)
    torch.testing.assert_close(grad_k2, grad_kl)
    assert grad_kl.abs().max() > 1e-3 and grad_k1.abs().max() < 1e-12


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_aggregation_modes_against_float64_references(agg):
    torch.manual_seed(1)
    B, T = 6, 5
    logp = torch.randn(B, T, dtype=torch.float64) * 0.3
    old = logp + torch.randn(B, T, dtype=torch.float64) * 0.3
    adv = torch.randn(B, T, dtype=torch.float64)
    lengths = [5, 1, 3, 0, 4, 2]  # a row without a loss token counts as no sequence
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    cfg = pt.Config(loss_agg=agg, response_length=T)
    tokens, denominators, row_weight, _ = pt.loss_denominators(SimpleNamespace(loss_mask=mask), [torch.arange(B)],
                                                               cfg)

    def loss(rows):  # one micro-batch's share
        weight = None if row_weight is None else row_weight[rows][:, None]
        share = pt.Share(tokens[0], denominators[0], weight)
        return objective(logp[rows], old[rows], adv[rows], mask[rows], share)[0]
    seqs = []
    for b in range(B):
        terms = []
        for t in range(lengths[b]):
            r, a = math.exp(logp[b, t] - old[b, t]), float(adv[b, t])
            terms.append(-min(r * a, min(max(r, 0.8), 1.2) * a))
        if terms:
            seqs.append(terms)
    expected = {"token-mean": sum(map(sum, seqs)) / sum(map(len, seqs)),
                "seq-mean-token-mean": sum(sum(s) / len(s) for s in seqs) / len(seqs),
                "seq-mean-token-sum-norm": sum(sum(s) / T for s in seqs) / len(seqs)}[agg]
    assert math.isclose(float(loss(torch.arange(B))), expected, rel_tol=1e-6)
    assert math.isclose(float(loss(torch.arange(3)) + loss(torch.arange(3, B))), expected, rel_tol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# the update: the first minibatch's ratio, micro-batches, clipping, AdamW and the lr decay, token budgets, packing,
# gradient checkpointing and bf16, non-finite loss skips


def test_ratio_is_exactly_one_on_the_first_minibatch_and_later_values_clip_around_the_rollouts(tokenizer):
    cfg, policy, reference, critic, batch = tiny_setup(tokenizer, micro_batch_size=2, value_clip_range=1e-4)
    orders = [torch.randperm(8) for _ in range(cfg.ppo_epochs)]
    score(batch, policy, reference, critic, constant_reward(1.0), cfg, orders[0])
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (policy, critic)]
    stats = pt.ppo_update(policy, critic, *opts, batch, cfg, orders)
    assert stats["first_ratio_max_dev"] == 0.0
    assert stats["approx_kl"] > 0  # the later minibatches did move the policy
    assert stats["vf_clipfrac"] > 0  # and the critic, past 1e-4 of the rollout's values (clipped around V_t itself:
    # never)


def sgd_update(tokenizer, prepare=None, edit_batch=None, **cfg_overrides):  # one ppo_update with plain SGD (lr 1)
    """The step is the gradient. Returns (stats, the policy's step, the critic's step)."""
    cfg, policy, reference, critic, batch = tiny_setup(tokenizer, **cfg_overrides)
    if prepare is not None:
        prepare(policy, critic)
    if edit_batch is not None:
        edit_batch(batch)
    orders = [torch.randperm(8, generator=torch.Generator().manual_seed(0)) for _ in range(cfg.ppo_epochs)]
    score(batch, policy, reference, critic, lambda b: torch.arange(8.0), cfg, orders[0])
    before = [[p.detach().clone() for p in m.parameters()] for m in (policy, critic)]
    opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in (policy, critic)]
    stats = pt.ppo_update(policy, critic, *opts, batch, cfg, orders)
    return stats, *([p.detach() - b for p, b in zip(m.parameters(), old)] for m, old in zip((policy, critic), before))


def test_the_first_minibatch_steps_on_scorings_forward_and_gets_the_recomputed_update(tokenizer):
    """Scoring keeps the first minibatch's policy graph, so its update step runs no policy forward of its own; the
    critic's is not kept (both models' activations would be held together, from scoring to the first backward: the
    GPU review's regression), and the update reruns it. The weights equal those of an update that reruns both, to the
    bit. Split into micro-batches (memory), nothing is kept."""
    weights = []
    for reuse, micro in ((True, 0), (False, 0), (False, 2)):
        cfg, policy, reference, critic, batch = tiny_setup(tokenizer, ppo_epochs=2, minibatches=2,
                                                           micro_batch_size=micro)
        grads = []  # per forward of the policy or the critic: whether it builds a graph
        for backbone in (pt.backbone_of(policy), critic.backbone):
            backbone.register_forward_pre_hook(lambda *a: grads.append(torch.is_grad_enabled()))
        orders = [torch.randperm(8, generator=torch.Generator().manual_seed(0)) for _ in range(2)]
        score(batch, policy, reference, critic, lambda b: torch.arange(8.0), cfg, orders[0])
        assert grads == ([True, False, False, False] if not micro else [False] * 8)  # (policy, critic) x 2
        batch.first_forward = batch.first_forward if reuse else None
        grads.clear()
        pt.ppo_update(policy, critic, *[torch.optim.SGD(m.parameters(), lr=1.0) for m in (policy, critic)], batch,
                      cfg, orders)
        assert len(grads) == (7 if reuse else 8 if not micro else 16) and all(grads)  # 2 epochs x 2 minibatches
        weights.append([p.detach().clone() for m in (policy, critic) for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(weights[0], weights[1]))
    for a, b in zip(weights[0], weights[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_micro_batch_accumulation_gives_the_minibatch_gradient(tokenizer):
    no_clip = dict(ppo_epochs=1, minibatches=1, max_grad_norm=1e9)  # (a clipped step would hide a uniform scale error)
    _, whole, whole_critic = sgd_update(tokenizer, **no_clip)
    _, micro, micro_critic = sgd_update(tokenizer, **no_clip, micro_batch_size=2)
    for a, b in zip(whole + whole_critic, micro + micro_critic):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert max(float(a.abs().max()) for a in whole) > 1e-4 and max(float(a.abs().max()) for a in whole_critic) > 1e-4


def shorten(batch):  # completions of 1 to 4 tokens: the sequence means then differ from the token mean
    for row, n in enumerate([4, 1, 3, 2, 4, 1, 2, 3]):
        batch.response_mask[row, n:] = 0


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_aggregation_is_the_same_however_the_minibatch_is_split(tokenizer, agg):
    no_clip = dict(ppo_epochs=1, minibatches=1, max_grad_norm=1e9, loss_agg=agg)
    (stats, whole, whole_critic), *splits = [sgd_update(tokenizer, edit_batch=shorten, micro_batch_size=m, **no_clip)
                                             for m in (0, 4, 2)]  # one micro-batch, two, four
    for split_stats, step, critic_step in splits:
        for a, b in zip(whole + whole_critic, step + critic_step):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        assert math.isclose(split_stats["pg_loss"], stats["pg_loss"], rel_tol=1e-5, abs_tol=1e-7)
    _, token_mean, _ = sgd_update(tokenizer, edit_batch=shorten, **{**no_clip, "loss_agg": "token-mean"})
    assert not all(torch.allclose(a, b) for a, b in zip(token_mean, whole))  # the mode does change the step


def test_critic_free_update_trains_the_policy_alone_with_the_kl_in_its_loss(tokenizer):
    cfg, policy, reference, _, batch = tiny_setup(tokenizer, advantage="grpo", samples_per_prompt=4, ppo_epochs=1,
                                                  minibatches=1, kl_coef=0.5)
    score(batch, policy, reference, None, lambda b: torch.arange(8.0), cfg)
    before = [p.detach().clone() for p in policy.parameters()]
    stats = pt.ppo_update(policy, None, torch.optim.SGD(policy.parameters(), lr=1.0), None, batch, cfg,
                          [torch.arange(8)])
    assert not any(k in stats for k in ("vf_loss", "vf_clipfrac", "critic_grad_norm"))
    mask = batch.response_mask.bool()  # the first minibatch: logprobs == old_logprobs
    k3 = pt.kl_estimate(batch.old_logprobs, batch.ref_logprobs, "k3")[mask]
    assert math.isclose(stats["kl_loss"], float(k3.mean()), rel_tol=1e-5) and stats["kl_loss"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    cfg.drop_flat_groups = True  # every group flat and dropped: no loss token anywhere, so no optimizer step
    score(batch, policy, reference, None, constant_reward(1.0), cfg)
    adam = torch.optim.AdamW(policy.parameters(), lr=1.0)
    pt.ppo_update(policy, None, adam, None, batch, cfg, [torch.arange(8)])
    assert batch.row_stats["zero_std_groups"] == 2 and not adam.state  # AdamW never stepped


def test_prompts_come_in_fresh_random_epochs_and_a_grouped_batch_draws_one_per_group(tmp_path, monkeypatch):
    first, again = list(itertools.islice(pt.prompt_order(5, seed=3), 15)), pt.prompt_order(5, seed=3, start=7)
    assert all(sorted(first[i:i + 5]) == list(range(5)) for i in (0, 5, 10)) and first[:5] != first[5:10]
    assert list(itertools.islice(again, 8)) == first[7:]  # (a resume skips what was drawn)
    write_reward_module(tmp_path)
    monkeypatch.chdir(tmp_path)
    finished = []
    monkeypatch.setattr(pt, "finish_training", finished.append)
    cfg = pt.parse_config([*LOOP, "--steps", "2", "--advantage", "rloo", "--samples-per-prompt", "4",
                           "--output-dir", "run"])
    os.makedirs(cfg.output_dir)
    pt.train(cfg, pt.setup(cfg), cfg.output_dir)
    assert finished[0].prompts_drawn == 2 * 16 // 4  # (16 completions a batch: 4 prompts, 4 completions each)


def test_dynamic_sampling_fills_the_batch_with_groups_that_have_signal_within_its_bound(tokenizer):
    """DAPO's dynamic sampling: rounds of prompts until the batch holds --batch-size completions from groups whose
    scores differ, signal first in the order sampled; at most --dynamic-sampling more rounds, then flat groups fill
    the rest (out of the loss). Rows keep their own tokens, whatever each round's widths; the log says how much."""
    policy = tiny_llama(len(tokenizer), seed=4, dtype=torch.float32)
    cfg = pt.Config(advantage="grpo", batch_size=8, samples_per_prompt=2, dynamic_sampling=2, minibatches=1)
    rounds, calls = [], []
    for k, scores in enumerate(([0, 0, 1, 0, 2, 2, 3, 3], [5, 5, 0, 1, 1, 1, 0, 0], [0, 2, 7, 7, 1, 0, 4, 4])):
        texts = [f"{k}{g}+{g}=" for g in range(4) for _ in range(2)]  # a round's 4 prompts, each a group of 2
        batch = demo_rollout(tokenizer, policy, texts, T=2 + k, seed=k)  # (three response widths)
        batch.raw_scores = batch.scores = torch.tensor(scores, dtype=torch.float32)
        batch.gen_s, batch.prompts_drawn = 1.0, 4 * (k + 1)
        rounds.append(batch)

    def sample_round(round_):  # the next round, as make_batch's sample_and_reward gives it
        calls.append(round_ - 1)
        return rounds[len(calls)]

    out = pt.dynamic_sampling(rounds[0], sample_round, cfg, tokenizer.pad_token_id)
    assert calls == [0, 1] and out.prompts == ["01+1="] * 2 + ["11+1="] * 2 + ["20+0="] * 2 + ["22+2="] * 2
    assert not pt.flat_groups(out.scores, 2).any() and out.scores.tolist() == [1, 0, 0, 1, 0, 2, 1, 0]
    assert out.row_stats == {"sampling_rounds": 3, "filtered_frac": 1 - 4 / 12} and out.prompts_drawn == 12
    assert out.gen_s == 3.0
    for row, (k, r) in enumerate([(0, 2), (0, 3), (1, 2), (1, 3), (2, 0), (2, 1), (2, 4), (2, 5)]):
        source, n = rounds[k], int(rounds[k].response_mask[r].sum())
        assert torch.equal(out.response[row, :n], source.response[r, :n]) and out.response_mask[row].sum() == n
        assert torch.equal(out.behav_logprobs[row, :n], source.behav_logprobs[r, :n]) and out.completions[row] == \
            source.completions[r]
        prompt = source.prompt_ids[r][source.prompt_mask[r].bool()]  # left-padded to the widest round's prompts
        assert torch.equal(out.prompt_ids[row][out.prompt_mask[row].bool()], prompt)
    for batch in rounds:  # no round with a group of signal: at most --dynamic-sampling more, then flat groups
        batch.raw_scores = batch.scores = torch.ones(8)
    calls.clear()
    out = pt.dynamic_sampling(rounds[0], sample_round, pt.dataclasses.replace(cfg, dynamic_sampling=1), 0)
    assert calls == [0] and out.prompts == rounds[0].prompts and out.row_stats["filtered_frac"] == 1.0
    pt.choose_loss_tokens(out, cfg)  # then out of the loss, as without dynamic sampling
    assert not out.loss_mask.any() and out.row_stats["zero_std_groups"] == 4


def test_rows_without_a_loss_token_skip_the_update_and_change_nothing(tokenizer):
    cfg, policy, reference, _, batch = tiny_setup(tokenizer, advantage="grpo", samples_per_prompt=4, ppo_epochs=1,
                                                  minibatches=1, drop_flat_groups=True)
    first_group = torch.arange(4)  # the second group is flat: dropped from the loss
    copy = pt.copy.deepcopy(policy)
    seen = []
    for model in (policy, reference):
        pt.backbone_of(model).register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    kl = score(batch, policy, reference, None, lambda b: torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), cfg)
    assert batch.row_stats["zero_std_groups"] == 1 and not batch.loss_mask.bool()[4:].any()
    assert batch.loss_mask.bool()[:4].equal(batch.response_mask[:4].bool()) and not kl[4:].any()  # the sampler's values
    pt.ppo_update(policy, None, torch.optim.SGD(policy.parameters(), lr=1.0), None, batch, cfg, [torch.arange(8)])
    assert seen == [4, 4]  # the reference, the scoring pass (its graph the update's): only the rows with loss tokens
    pt.ppo_update(copy, None, torch.optim.SGD(copy.parameters(), lr=1.0), None, batch.rows(first_group), cfg,
                  [first_group])  # the same step from a batch that never held the flat group
    for a, b in zip(policy.parameters(), copy.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    cfg.kl_in = "reward"  # a KL in the reward enters the group baselines: every row is scored
    seen.clear()
    score(batch, policy, reference, None, lambda b: torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), cfg)
    pt.ppo_update(policy, None, torch.optim.SGD(policy.parameters(), lr=1.0), None, batch, cfg, [torch.arange(8)])
    assert seen == [8, 8]


def test_gradient_clipping_bounds_each_step(tokenizer):
    stats, step, _ = sgd_update(tokenizer, ppo_epochs=1, minibatches=1, max_grad_norm=1e-3)
    assert stats["grad_norm"] > 1e-3  # clipping was needed ...
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(s) for s in step])))
    assert abs(norm - 1e-3) < 1e-6  # ... and the step (lr 1) has exactly the clipped norm
    stats, step, _ = sgd_update(tokenizer, ppo_epochs=1, minibatches=1, max_grad_norm=0)  # 0: no clip (as HF's)
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(s) for s in step])))
    assert math.isclose(norm, stats["grad_norm"], rel_tol=1e-5) and norm > 1e-3


def test_adamw_eps_and_linear_lr_decay(tokenizer):
    cfg = pt.Config(steps=10, lr=1e-3)
    policy, critic = tiny_llama(len(tokenizer), dtype=torch.float32), tiny_llama(len(tokenizer), dtype=torch.float32)
    policy_opt, critic_opt, schedules = pt.make_optimizers(cfg, policy, critic)
    assert policy_opt.param_groups[0]["eps"] == 1e-5 and critic_opt.param_groups[0]["lr"] == cfg.critic_lr
    assert [o.param_groups[0]["weight_decay"] for o in (policy_opt, critic_opt)] == [0.0, 0.0]  # (AdamW's own: 0.01)
    given = pt.make_optimizers(pt.Config(adam_eps=1e-7, weight_decay=0.1), policy, critic)[:2]
    assert [(o.param_groups[0]["eps"], o.param_groups[0]["weight_decay"]) for o in given] == [(1e-7, 0.1)] * 2
    lrs = []
    for _ in range(10):
        lrs.append(schedules[0].get_last_lr()[0])
        policy_opt.step()
        schedules[0].step()
    assert lrs == pytest.approx([1e-3 * (1 - s / 10) for s in range(10)])
    cfg.lr_decay = False
    policy_opt, _, schedules = pt.make_optimizers(cfg, policy, critic)
    policy_opt.step()
    schedules[0].step()
    assert schedules[0].get_last_lr()[0] == 1e-3


def test_token_budget_micro_batches_cover_every_token_once(tokenizer):
    cfg = pt.Config(batch_size=28, minibatches=2, micro_batch_tokens=40)
    g = torch.Generator().manual_seed(1)
    prompt_mask = (torch.arange(12) >= 12 - torch.randint(1, 13, (28, 1), generator=g)).long()  # 1..12 real tokens
    response_mask = (torch.arange(9) < torch.randint(1, 10, (28, 1), generator=g)).long()  # 1..9 real tokens
    batch = pt.Rollout(torch.ones(28, 12, dtype=torch.long), prompt_mask, torch.ones(28, 9, dtype=torch.long),
                       response_mask, None, None, None)
    lengths = (batch.prompt_mask.sum(1) + batch.response_mask.sum(1)).tolist()
    order = torch.randperm(28, generator=g)
    groups = pt.micro_batch_rows(batch, order.split(14), cfg)
    for minibatch, micro in zip(order.split(14), groups):
        rows = torch.cat(micro)
        assert sorted(rows.tolist()) == sorted(minibatch.tolist())  # every row (so every token) exactly once
        assert all(sum(lengths[r] for r in m.tolist()) <= 40 for m in micro)  # within the budget
        assert len(micro) > 1
    bins = pt.token_budget_bins([5, 30, 7, 30, 2, 9], 40, bins=5)  # at least 5 bins (ranks that must agree)
    assert len(bins) == 5 and sorted(i for b in bins for i in b) == list(range(6))
    assert pt.token_budget_bins([50, 3], 40) == [[0], [1]]  # a row over the budget gets a micro-batch of its own


def test_packed_training_matches_padded_training(tokenizer, monkeypatch):
    results, sizes = [], []
    packed_inputs = pt.packed_inputs

    def counted(b):  # count the packed micro-batches and their real tokens
        sizes.append(int(b.prompt_mask.sum() + b.response_mask.sum()))
        return packed_inputs(b)

    monkeypatch.setattr(pt, "packed_inputs", counted)
    for packed in (False, True):
        cfg, policy, reference, critic, batch = tiny_setup(tokenizer, **({"micro_batch_tokens": 20} if packed else {}))
        if packed:
            for backbone in (pt.backbone_of(policy), critic.backbone, pt.backbone_of(reference)):
                assert pt.use_packed_attention(backbone) == ""
            sizes.clear()  # (the checks' packed batches)
        orders = [torch.randperm(8, generator=torch.Generator().manual_seed(0)) for _ in range(cfg.ppo_epochs)]
        score(batch, policy, reference, critic, lambda b: torch.arange(8.0), cfg, orders[0])
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (policy, critic)]
        stats = pt.ppo_update(policy, critic, *opts, batch, cfg, orders)
        assert stats["first_ratio_max_dev"] == 0.0  # the packed scoring pass and the first epoch agree to the bit
        results.append((batch, stats, [p.detach().clone() for p in policy.parameters()]))
    (a, sa, wa), (b, sb, wb) = results
    # --micro-batch-tokens 20 is honoured: more micro-batches than minibatches (2 minibatches of 4 rows, ~39 tokens
    # each, in the reference's, the trainer's and 2 epochs' passes), none over 20 real tokens, every token 4 times
    n_tokens = int(b.prompt_mask.sum() + b.response_mask.sum())
    assert len(sizes) > 2 * 4 and max(sizes) <= 20 and sum(sizes) == 4 * n_tokens
    for name in ("old_logprobs", "values", "advantages"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=1e-4, atol=1e-5)
    for k in ("pg_loss", "vf_loss", "entropy"):
        assert abs(sa[k] - sb[k]) < 1e-4, k
    for x, y in zip(wa, wb):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)


def test_decoder_layers_are_the_blocks_not_an_moe_layers_longer_list_of_experts():
    """Checkpointing, FSDP2's units, --offload and the memory line work per decoder layer: transformers 4's MoE models
    hold each layer's experts in a ModuleList longer than the list of layers (Qwen2-MoE: 60 experts, 24 layers)."""
    block = lambda: torch.nn.ModuleDict({"attention": torch.nn.Linear(8, 8),  # noqa: E731
                                         "experts": torch.nn.ModuleList(torch.nn.Linear(8, 2) for _ in range(6))})
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(10, 8), "layers": torch.nn.ModuleList([block(), block()])})
    assert pt.decoder_layers(model) is model["layers"]


def test_gradient_checkpointing_and_bf16_autocast_keep_the_update(tokenizer):
    _, plain, _ = sgd_update(tokenizer, ppo_epochs=1, minibatches=1)
    calls = []

    def checkpoint(policy, critic):
        for model in (policy, critic):
            pt.checkpoint_layers(model)
        mlp = pt.decoder_layers(policy)[0].mlp
        forward = mlp.forward

        def recorded(*args, **kwargs):  # whether each call of the first MLP builds a graph
            calls.append(torch.is_grad_enabled())
            return forward(*args, **kwargs)

        mlp.forward = recorded

    _, checkpointed, _ = sgd_update(tokenizer, prepare=checkpoint, ppo_epochs=1, minibatches=1)
    assert calls == [True, True]  # scoring (its graph the first minibatch's update's), the backward's recomputation
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    stats, bf16, _ = sgd_update(tokenizer, bf16=True, ppo_epochs=1, minibatches=1)
    assert stats["first_ratio_max_dev"] == 0.0  # scoring and the first epoch run under the same autocast
    bf16_step = torch.cat([s.reshape(-1) for s in bf16])
    plain_step = torch.cat([s.reshape(-1) for s in plain])
    assert torch.nn.functional.cosine_similarity(bf16_step, plain_step, dim=0) > 0.99
    assert float((bf16_step - plain_step).abs().max()) > 1e-5  # autocast did run: bf16 rounding moved the step
    for full_logits in (False, True):
        cfg, policy, _, _, batch = tiny_setup(tokenizer, bf16=True, full_logits=full_logits)
        pt.fp32_head(policy)  # what train() does under --bf16
        exact = pt.rollout_logprobs(policy, batch, cfg)[0]
        with pt.autocast(cfg, torch.device("cpu")):
            logits = policy(*pt.full_sequence(batch)).logits
            mixed = pt.rollout_logprobs(policy, batch, cfg)[0]
        assert logits.dtype == torch.float32 and mixed.dtype == torch.float32  # bf16 body, fp32 head
        assert 0 < float((mixed - exact).detach().abs().max()) < 0.05


def test_non_finite_loss_skips_the_update_and_leaves_the_weights_alone(tokenizer):
    cfg, policy, reference, critic, batch = tiny_setup(tokenizer)
    orders = [torch.randperm(8) for _ in range(cfg.ppo_epochs)]
    score(batch, policy, reference, critic, constant_reward(1.0), cfg, orders[0])
    batch.advantages[:, 0] = float("inf")  # every minibatch's loss is non-finite
    before = [p.detach().clone() for p in policy.parameters()]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (policy, critic)]
    stats = pt.ppo_update(policy, critic, *opts, batch, cfg, orders)
    assert stats["nonfinite"].startswith("policy loss")
    assert "epoch 1 minibatch 1 (after 0 finite steps)" in stats["nonfinite"]
    assert all(torch.equal(p, b) for p, b in zip(policy.parameters(), before))
    assert all(p.grad is None for p in policy.parameters())
    assert pt.nonfinite(batch) == "advantages in rows [0, 1, 2, 3, 4, 5, 6, 7] of 8"
    batch.behav_logprobs[3, 1] = float("nan")  # a sampler whose logits went NaN (its draws are not checked)
    assert pt.nonfinite(batch) == "behav_logprobs in rows [3] of 8"
    cfg, policy, reference, critic, batch = tiny_setup(tokenizer)  # a finite loss, a NaN gradient
    score(batch, policy, reference, critic, constant_reward(1.0), cfg, orders[0])
    policy.lm_head.weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    before = [p.detach().clone() for p in policy.parameters()]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (policy, critic)]
    assert pt.ppo_update(policy, critic, *opts, batch, cfg, orders)["nonfinite"].startswith("policy grad norm at")
    assert all(torch.equal(p, b) for p, b in zip(policy.parameters(), before))


# ---------------------------------------------------------------------------------------------------------------
# the loop, end to end: the real entry point, on tiny budgets (the demo, model and reward model directories,
# staleness 0 and 1, in-flight updates, sampler errors and SIGTERM)


def run_main(args, cwd):
    """The entry point run in this process as `python ppo_tokens.py ARGS` runs it in cwd, without a subprocess's seconds
    of imports: its exit status, stdout and stderr (where the interpreter prints a SystemExit's message)."""
    out, err = io.StringIO(), io.StringIO()
    status = 0
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            pt.main([str(a) for a in args])
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                status = e.code
            else:  # a message: the interpreter prints it and exits with status 1
                print(e.code, file=sys.stderr)
                status = 1
    forget_modules_from(cwd)
    return subprocess.CompletedProcess(args, status or 0, out.getvalue(), err.getvalue())


def run_script(args, cwd):
    proc = run_main(args, cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_outputs(output_dir, steps, tokenizer_check=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    config = json.load(open(os.path.join(output_dir, "config.json")))
    assert config["steps"] == steps and config["response_length"] > 0  # resolved values, as used
    records = [r for r in read_metrics(output_dir) if r["step"] > 0]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for key in ("reward_mean", "kl", "entropy", "clipfrac", "response_tokens", "iter_s", "time_s",
                "gen_tokens_per_s", "train_tokens_per_s", "vf_loss", "explained_variance", "approx_kl"):
        assert all(isinstance(r[key], (int, float)) and math.isfinite(r[key]) for r in records), key
    assert all(0 < r["peak_rss_gb"] < 64 for r in records) and "peak_memory_gb" not in records[0]  # (CPU: the host's)
    assert all(r["first_ratio_max_dev"] == 0.0 for r in records)
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(output_dir, "policy"))
    tok = AutoTokenizer.from_pretrained(os.path.join(output_dir, "policy"))
    assert tok.pad_token_id != tok.eos_token_id
    ids = tok(["1+2="], return_tensors="pt").input_ids
    assert policy(input_ids=ids).logits.shape[-1] >= len(tok)
    return records


TINY = ["--batch-size", "16", "--minibatches", "2", "--micro-batch-size", "4", "--steps", "3", "--eval-size", "40",
        "--eval-every", "2", "--demo-warmup-steps", "0", "--sample-every", "2", "--device", "cpu"]  # (bit-exact)


@slow
def test_demo_learns_a_little_in_a_few_iterations(tmp_path):
    """A shortened default demo (the full one is in the README): after a real warm-up, the reward mean rises and so
    does the held-out accuracy. After 600 warm-up steps, not the default 1,000 (40 s less here), the reward starts
    at 0.2-0.9 (by seed and CPU: the warm-up's loss drops at 300-600 steps), and its last 8 batches' mean rose
    0.07-0.13 over the first 8's (seeds 1-3 and 450 steps' 0.11-0.13; after 1,000 steps: 0.05). That difference has a
    noise of ~0.01, so the test asks for 0.02 (a policy that learns nothing passes ~2% of the time, and then must
    raise the accuracy too)."""
    torch.set_num_threads(2)  # not the suite's one (see the top): 1.2x faster, in the slow tier's longest test
    out = run_script(["--demo-warmup-steps", "600", "--steps", "24", "--eval-every", "12", "--eval-size", "500",
                      "--sample-every", "0", "--device", "cpu", "--output-dir", str(tmp_path / "run"), "--demo-cache",
                      str(tmp_path / "cache")], tmp_path)
    before, *records = read_metrics(tmp_path / "run")  # step 0: the held-out accuracy before PPO
    first = statistics.fmean(r["reward_mean"] for r in records[:8])
    last = statistics.fmean(r["reward_mean"] for r in records[-8:])
    assert last > first + 0.02 and records[-1]["eval_accuracy"] > before["eval_accuracy"], (first, last, out[-2000:])
    assert "warm-up:" in out and "held-out sampled accuracy" in out


def test_an_edited_warm_up_is_not_loaded_from_the_cache_of_the_old_one(tmp_path, capsys, monkeypatch):
    """The warm-up's cache key holds its training pairs (another --eval-size holds out others: a policy warmed up on
    this run's held-out pairs must not load) and the source of what it runs: a researcher's edit warms up anew."""
    cfg = pt.Config(device="cpu", demo_warmup_steps=2, demo_cache=str(tmp_path))
    tokenizer, pairs = pt.build_demo_tokenizer(), [(a, b) for a in range(20) for b in range(20)]

    def warm_up(pairs=pairs):
        pt.demo_warmup(pt.build_demo_policy(tokenizer, 1, 32, 1), tokenizer, cfg, pairs)
        return capsys.readouterr().out

    assert "loaded" not in warm_up() and "loaded" in warm_up()
    assert "loaded" not in warm_up(pairs[10:]) and "loaded" in warm_up(pairs[10:])
    getsource = pt.inspect.getsource
    monkeypatch.setattr(pt.inspect, "getsource", lambda f: getsource(f) + ("# an edit\n" if f is pt.retry_hint else ""))
    assert "loaded" not in warm_up() and "loaded" in warm_up() and len(os.listdir(tmp_path)) == 3


def test_an_eval_size_that_leaves_the_demo_too_few_sums_to_train_on_is_refused():
    message = "--eval-size 4000 leaves 95 of this demo's 4095 sums to train on; at most 3839"  # (sums below 90)
    with pytest.raises(SystemExit, match=message):
        pt.addition_task(pt.make_config(env="demo", eval_size=4000))


def test_demo_entry_point_with_a_reward_model_directory(tmp_path, tokenizer):
    """The demo policy with a learned reward model saved as an AutoModelForSequenceClassification directory."""
    from transformers import LlamaConfig, LlamaForSequenceClassification
    rm = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=64, num_labels=1,
                                                    pad_token_id=tokenizer.pad_token_id))
    rm.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    out = run_script([*TINY, "--reward-model", str(tmp_path / "rm"), "--output-dir", str(tmp_path / "run"),
                      "--demo-cache", str(tmp_path / "cache")], tmp_path)
    assert "critic from the reward model" in out
    records = check_outputs(tmp_path / "run", 3)
    assert "eval_accuracy" in read_metrics(tmp_path / "run")[0] and "eval_accuracy" in records[-1]


def test_a_users_task_gives_the_prompts_reward_model_and_evaluation_that_no_flag_gives(tmp_path):
    """--task module:factory: the run takes the task's prompts, reward, model and held-out evaluation, as the demo's
    (a flag given would win: here none is)."""
    (tmp_path / "my_task.py").write_text(
        "import sys\nsys.path.insert(0, %r)\nimport ppo_tokens\n"
        "def score(prompts, completions):\n    open('seen.txt', 'a').write(''.join(prompts))\n"
        "    return [float('7' in c) for c in completions]\n"
        "def sevens(cfg):\n    tokenizer = ppo_tokens.build_demo_tokenizer()\n"
        "    return ppo_tokens.Task(prompts=['7+7=', '17+7='], reward=score, model=lambda cfg: (tokenizer, "
        "ppo_tokens.build_demo_policy(tokenizer, cfg.seed, 32, 1)),\n"
        "                           evaluate=lambda policy, tokenizer, cfg: {'eval_accuracy': 0.25})\n" % HERE)
    argv = [a for a in LOOP if a not in ("--reward", "count_ones:score")]
    out = run_script([*argv, "--task", "my_task:sevens", "--steps", "2", "--output-dir", str(tmp_path / "run")],
                     tmp_path)
    seen = (tmp_path / "seen.txt").read_text()
    assert len(seen) == 2 * 8 * (4 + 5) and seen.replace("17+7=", "").replace("7+7=", "") == ""  # its prompts
    assert "policy 0.01M parameters" in out  # its model (the demo's is 0.60M)
    assert [r.get("eval_accuracy") for r in read_metrics(tmp_path / "run")] == [0.25, None, 0.25]  # its evaluation


def test_memory_line_counts_each_part_and_a_run_that_cannot_fit_stops_before_loading(tmp_path, tokenizer, capsys,
                                                                                      monkeypatch):
    """At start, one line: each part's bytes before activations (fp32 policy and critic with their gradients and
    Adam, the frozen reference and reward model, the sampler; --lora-rank: one base, the adapters) against the
    device's memory. A --model run that exceeds it stops before any weights load, naming what would fit."""
    from transformers import LlamaConfig, LlamaForSequenceClassification
    model = tiny_llama(len(tokenizer), dtype=torch.float32, hidden_size=128, intermediate_size=256)
    n, n_backbone = (sum(p.numel() for p in m.parameters()) for m in (model, model.model))
    n_lora = sum(m.in_features + m.out_features for m in model.model.modules() if isinstance(m, torch.nn.Linear))
    model.save_pretrained(tmp_path / "policy_in")
    tokenizer.save_pretrained(tmp_path / "policy_in")
    rm = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=64, num_labels=1))
    rm.save_pretrained(tmp_path / "rm")
    word_tokenizer(len(tokenizer)).save_pretrained(tmp_path / "rm")  # (not the policy's: the critic is not its copy)
    n_rm = sum(p.numel() for p in rm.parameters())
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1="}\n')
    argv = ["--model", str(tmp_path / "policy_in"), "--reward-model", str(tmp_path / "rm"), "--prompts",
            str(tmp_path / "p.jsonl"), "--device", "cpu", "--no-bf16"]
    loaded = []
    monkeypatch.setattr(pt, "load_policy", lambda *a: loaded.append(a) or sys.exit("loaded"))
    capacity = pt.device_memory(torch.device("cpu"))
    full = {"policy": 4 * n, "policy grads+Adam": 12 * n, "critic": 4 * n_backbone,
            "critic grads+Adam": 12 * n_backbone, "reference": 4 * n, "reward model": 4 * n_rm,
            "sampler": 4 * n}  # (fp32 frozen models on a CPU; --max-staleness 0: no staging copy)
    lora = {"base": 4 * n, "policy adapters+grads+Adam": 16 * 4 * n_lora, "critic adapters+grads+Adam": 16 * 4 * n_lora,
            "reward model": 4 * n_rm, "sampler": 4 * n}  # (rank 4: 4 x (in + out) a linear layer)
    for flags, parts in (([], full), (["--lora-rank", "4"], lora)):
        with pytest.raises(SystemExit, match="loaded"):
            pt.setup(pt.parse_config([*argv, *flags]))
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("memory on cpu"))
        shown = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in parts.items())
        assert line.endswith(f"MiB: {shown} = {sum(parts.values()) / 2**20:.2f} of {capacity / 2**20:.0f}")
    assert not pt.critic_copies_reward(pt.parse_config(argv))  # the critic copies the reward model where their
    rm.save_pretrained(tmp_path / "rm_same")  # tokenizers agree (build_critic), and is counted so
    tokenizer.save_pretrained(tmp_path / "rm_same")
    same = [*argv, "--reward-model", str(tmp_path / "rm_same")]
    assert pt.critic_copies_reward(pt.parse_config(same)) and not pt.critic_copies_reward(pt.parse_config(
        [*same, "--lora-rank", "4"]))
    copied = pt.memory_parts(pt.parse_config(same), torch.device("cpu"), 1, model, rm, copies_reward=True)
    assert copied == {**full, "critic": 4 * n_rm, "critic grads+Adam": 12 * n_rm, "Adam at a step": 0,
                      "publish's gather": 0}
    with pytest.raises(SystemExit, match="loaded"):  # (as setup counts it)
        pt.setup(pt.parse_config(same))
    assert f"critic {4 * n_rm / 2**20:.2f}, critic grads+Adam {12 * n_rm / 2**20:.2f}, " in capsys.readouterr().out
    q = dataclasses.replace(pt.parse_config(argv), lora_rank=4, lora_targets="self_attn.q_proj")  # (peft's suffix rule)
    n_q = sum(layer.self_attn.q_proj.in_features + layer.self_attn.q_proj.out_features for layer in model.model.layers)
    assert pt.memory_parts(q, torch.device("cpu"), 1, model, rm)["policy adapters+grads+Adam"] == 16 * 4 * n_q > 0
    fsdp = dataclasses.replace(pt.parse_config(argv), fsdp=True)  # FSDP2 at 2 ranks: all but the sampler sharded
    halves = {k: v if k == "sampler" else v / 2 for k, v in full.items()}
    assert {k: v for k, v in pt.memory_parts(fsdp, torch.device("cpu"), 2, model, rm).items() if v} == {
        **halves, "publish's gather": 4 * n}  # (a publish receives every rank's shards: a whole model for a moment)
    trees = {"policy base": 2 * n, "critic base": 2 * n_backbone, "reference": 2 * n}  # LoRA: each tree's shards
    assert pt.memory_parts(dataclasses.replace(fsdp, lora_rank=4), torch.device("cpu"), 2, model, rm) == {
        **trees, **{k: v if k == "sampler" else v / 2 for k, v in lora.items() if k != "base"}}
    stale = dataclasses.replace(fsdp, max_staleness=1)  # CUDA's sampler thread: the frozen models stay whole
    gpu = torch.device("cuda")
    assert pt.memory_parts(stale, gpu, 2, model, rm)["reference"] == 4 * n
    assert pt.memory_parts(stale, gpu, 2, model, rm)["sampler"] == 2 * 2 * n  # bf16, and the publish's staging copy
    offload = dataclasses.replace(pt.parse_config(argv), offload=True)  # a GPU's: Adam in for its step, one layer
    layers, layer = (sum(p.numel() for p in m.parameters()) for m in (model.model.layers, model.model.layers[0]))
    parts = pt.memory_parts(offload, gpu, 1, model, rm)  # (of each frozen model and its embeddings)
    assert parts["reference"] == 4 * (n - layers + layer) and parts["policy grads+Adam"] == 4 * n
    assert parts["Adam at a step"] == 8 * n and sum(parts.values()) < sum(pt.memory_parts(stale, gpu, 1, model, rm)
                                                                          .values())
    sharded = pt.memory_parts(dataclasses.replace(offload, fsdp=True), gpu, 2, model, rm)  # + FSDP2's CPUOffload:
    assert sharded["trained, gathered"] == 8 * (n - layers + layer) and "policy" not in sharded  # (all on the host)
    monkeypatch.setattr(pt, "device_memory", lambda device: sum(parts.values()) + 1)  # holds it offloaded only
    with pytest.raises(SystemExit, match=r"try --lora-rank 16 \(~0 GiB\) or --offload \(~0 GiB\) or sharding"):
        pt.plan_memory(pt.parse_config(argv), gpu, 1, model, rm)
    # the host's line (--offload): Adam's moments and the frozen models' layers in pinned slabs, a little over their
    # bytes (test_offload_on_a_cpu_... checks it against what is pinned); FSDP2: each rank's shards, each pinned one
    # rounded up to a power of two (so at most twice), Adam's moments there unpinned
    rm_layers, critic = sum(p.numel() for p in rm.model.layers.parameters()), n_backbone + 128  # (+ the value head)
    exact = {"Adam moments": 8 * (n + critic), "reference": 4 * layers, "reward model": 4 * rm_layers}
    host = pt.host_parts(offload, gpu, 1, model, rm)
    assert host.keys() == exact.keys() and all(exact[k] <= host[k] < 1.5 * exact[k] for k in exact)
    assert pt.host_parts(stale, gpu, 1, model, rm) == {}
    fsdp_offload = dataclasses.replace(offload, fsdp=True)
    halves = {"trained weights+grads+Adam": (16 * (n + critic) / 2, 8 * (n + critic) / 2),  # (pinned, unpinned)
              "reference": (4 * n / 2, 0), "reward model": (4 * n_rm / 2, 0)}
    for lora, trees in (({}, {}), ({"lora_rank": 4}, {"base trees": (4 * (2 * n + n_backbone) / 2, 0)})):  # (each
        shards = pt.host_parts(dataclasses.replace(fsdp_offload, **lora), gpu, 2, model, rm)  # tree's: the policy's,
        expected = {**trees, **halves}  # the reference's, the critic's)
        if lora:
            expected.update({"trained weights+grads+Adam": (16 * 4 * 2 * n_lora / 2 + 128 * 8, 0), "reference": (0, 0)})
        assert shards.keys() == expected.keys()
        assert all(low <= shards[k] <= 2 * low - unpinned for k, (low, unpinned) in expected.items()), (lora, shards)
    lora_host = sum(pt.host_parts(dataclasses.replace(offload, lora_rank=16), gpu, 1, model, rm).values())
    ram = (lora_host + sum(host.values())) // 2  # a host that holds --offload with LoRA, not without
    monkeypatch.setattr(pt, "device_memory", lambda device: ram if device.type == "cpu" else 2**40)
    with pytest.raises(SystemExit, match=r"^--offload: this run needs ~0 GiB of host memory, more than its 0 GiB: try "
                                         r"--lora-rank 16 \(~0 GiB\) or a smaller model$"):
        pt.plan_memory(offload, gpu, 1, model, rm)
    shown = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in host.items())
    assert f"memory on the host (--offload), MiB: {shown} = {sum(host.values()) / 2**20:.2f} of {ram / 2**20:.0f}\n" \
        in capsys.readouterr().out
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on the host: twice the LoRA run's part still fits
    monkeypatch.setattr(pt, "device_memory", lambda device: 2 * lora_host + 1 if device.type == "cpu" else 2**40)
    pt.plan_memory(dataclasses.replace(offload, lora_rank=16), gpu, 1, model, rm)
    assert "memory on the host (--offload), per rank (2 on this host)" in capsys.readouterr().out
    monkeypatch.setattr(pt, "device_memory", lambda device: 2 * lora_host - 1 if device.type == "cpu" else 2**40)
    with pytest.raises(SystemExit, match="of host memory"):
        pt.plan_memory(dataclasses.replace(offload, lora_rank=16), gpu, 1, model, rm)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # a GPU that holds the run only offloaded, on a host too small for it:
    monkeypatch.setattr(pt, "device_memory", lambda device: 1 if device.type == "cpu" else sum(parts.values()) + 1)
    with pytest.raises(SystemExit, match=r"try --lora-rank 16 \(~0 GiB\) or sharding"):  # --offload not suggested
        pt.plan_memory(pt.parse_config(argv), gpu, 1, model, rm)
    loaded.clear()
    lora_16, held = sum(lora.values()) + 2 * 16 * 12 * n_lora, 8 * n  # (rank 16: 4 times the adapters; held: the
    # sampler, and the receive buffer of a publish's gather)
    small = (lora_16 + sum(full.values())) // 2  # a device that holds the run with --lora-rank 16, not without
    monkeypatch.setattr(pt, "device_memory", lambda device: small)
    gpus = math.ceil((sum(full.values()) - 4 * n) / (small - held))  # all but the sampler, sharded over the room left
    with pytest.raises(SystemExit, match=rf"needs ~0 GiB on cpu before activations, more than its 0 GiB: try "
                                         rf"--lora-rank 16 \(~0 GiB\) or sharding over {gpus} GPUs "
                                         rf"\(torchrun --nproc_per_node {gpus} \.\.\. --fsdp\) or a smaller model$"):
        pt.setup(pt.parse_config(argv))
    assert not loaded and gpus > 1  # stopped before the policy loaded
    monkeypatch.setattr(pt, "device_memory", lambda device: 3 * n)  # not even the sampler fits
    with pytest.raises(SystemExit, match=r"more than its 0 GiB: try a smaller model$"):
        pt.setup(pt.parse_config(argv))


def test_pinned_copies_are_views_of_few_power_of_two_slabs_each_tensor_once(monkeypatch):
    """--offload's pinned memory: torch's pinned allocator rounds each allocation up to a power of two, so tensors
    are cut, 512-byte aligned and without overlap, from slabs of one power-of-two size; any dtype, shape or none."""
    slabs, empty = [], torch.empty
    monkeypatch.setattr(torch, "empty", lambda *size, pin_memory=False, **kw: (  # (a CPU has no pinned memory)
        slabs.append(empty(*size, **kw)) or slabs[-1]) if pin_memory else empty(*size, **kw))
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=g).mul(9).to(dtype) for shape, dtype in
               [((0,), torch.float32), ((3, 5), torch.bfloat16), ((7,), torch.float64), ((), torch.float32),
                ((300, 17), torch.float32), ((2, 0, 3), torch.bfloat16), ((1000,), torch.int64)]]
    copies = pt.pinned_copies([t.t() if t.dim() == 2 else t for t in tensors])  # (strided sources too)
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and torch.equal(c, t.t() if t.dim() == 2 else t)
        assert any(0 <= c.data_ptr() - s.data_ptr() < s.nbytes or c.numel() == 0 for s in slabs)
    total, slab, places = pt.pinned_slabs([t.nbytes for t in tensors])
    assert slab & (slab - 1) == 0 and [s.nbytes for s in slabs] == [slab] * (total // slab) > []
    spans = sorted((i * slab + at, i * slab + at + t.nbytes) for t, (i, at) in zip(tensors, places) if t.nbytes)
    assert all(a % 512 == 0 and a < b <= c for (a, b), (c, _) in zip(spans, spans[1:] + [(total, 0)]))
    assert pt.pinned_slabs([]) == (0, 1, []) and pt.pinned_copies([]) == [] and len(slabs) == total // slab
    assert pt.pinned_slabs([600] * 3) == (3072, 1024, [(0, 0), (1, 0), (2, 0)])  # (a slab each, 512-aligned)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # (peft's from_pretrained)
@pytest.mark.parametrize("lora", [{}, {"lora_rank": 4}], ids=["full", "lora"])
def test_offload_on_a_cpu_moves_what_it_says_and_ends_with_a_resident_runs_weights_resumed_too(tmp_path, tokenizer,
                                                                                                 monkeypatch, lora):
    """--offload's logic, where a CPU can run it: the flag is refused on a CPU (no pinned memory), so here pinning is a
    plain allocation, a "device copy" a clone, and the flag is set after setup's check. Outside each forward the frozen
    models' decoder layers hold their host copies; after each step Adam's moments are back in their pinned slabs (a
    checkpoint reads them, a resume loads into them), whose bytes are the host line's; the run, its sampler thread
    scoring the reference, ends with a resident run's weights to the bit, and so does its resume (which once lost the
    moments it loaded: set_state_dict's initialising step wrote over them). Its GPU twin, not yet run:
    test_cuda_offload_ends_with_the_weights_of_a_resident_run."""
    from transformers import LlamaConfig, LlamaForSequenceClassification
    LlamaForSequenceClassification(LlamaConfig(  # (not the policy's shape: full fine-tuning's critic is its copy)
        vocab_size=len(tokenizer), hidden_size=48, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
        num_labels=1, pad_token_id=tokenizer.pad_token_id)).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    pinned, optimizers, copied_in, empty, offload_moments = [], [], [], torch.empty, pt.offload_moments
    monkeypatch.setattr(torch, "empty", lambda *size, pin_memory=False, **kw: (
        pinned.append(empty(*size, **kw)) or pinned[-1]) if pin_memory else empty(*size, **kw))

    def layer_copied_in(layer, device):  # a layer's device copy: not its host tensor
        copied_in.append(layer)
        for p, host in zip(layer.parameters(), layer.host_weights):
            p.data = host.clone()

    def moments_copied_in(optimizer):  # after offload_moments' pre-step hook: the step updates copies
        offload_moments(optimizer)
        optimizers.append(optimizer)

        def copy_in(*_):
            for state in optimizer.state.values():
                state.update({k: v.clone() for k, v in state.items() if v.dim()})
        optimizer.register_step_pre_hook(copy_in)
    chosen, offload_layers = [], pt.offload_layers  # the models setup offloads, offloaded once its refusal passed
    monkeypatch.setattr(pt, "offload_layers", lambda model, cfg, device: chosen.append(model) or model)
    monkeypatch.setattr(pt, "layer_to", layer_copied_in)
    monkeypatch.setattr(pt, "offload_moments", moments_copied_in)

    def train(name, offload, **flags):
        cfg = pt.make_config(demo_hidden=32, demo_layers=2, demo_warmup_steps=0, steps=3, batch_size=16, minibatches=2,
                             response_length=6, reward_model=str(tmp_path / "rm"), eval_size=40, sample_every=0,
                             save_every=2, device="cpu", demo_cache=str(tmp_path / "cache"), **lora, **flags)
        chosen.clear()
        run = pt.setup(cfg)
        if offload:  # (setup's refusal passed: what setup then does with the flag)
            cfg.offload = True
            for model in chosen:
                offload_layers(model, cfg, run.device)
        os.makedirs(tmp_path / name, exist_ok=True)
        pt.train(cfg, run, str(tmp_path / name), threaded=True)
        return cfg, run

    (_, resident), (cfg, offloaded) = train("resident", False), train("offloaded", True)
    frozen = (offloaded.reward_model,) if lora else (offloaded.reference.policy, offloaded.reward_model)
    assert [id(m) for m in chosen] == [id(m) for m in frozen]  # (LoRA's reference is the base: nothing to move)
    layers = [layer for m in frozen for layer in pt.decoder_layers(m)]
    assert all(p.data_ptr() == host.data_ptr() for layer in layers for p, host in zip(layer.parameters(),
                                                                                       layer.host_weights))
    assert {id(layer) for layer in copied_in} == {id(layer) for layer in layers}  # (each came in for its forwards)
    slabs = {slab.data_ptr(): slab.nbytes for slab in pinned}
    assert all(any(0 <= v.data_ptr() - at < size for at, size in slabs.items())  # (each moment a view of a slab)
               for optimizer in optimizers for state in optimizer.state.values() for v in state.values() if v.dim())
    parts = pt.host_parts(cfg, offloaded.device, 1, offloaded.reference.policy, offloaded.reward_model,
                          pt.critic_copies_reward(cfg, offloaded.tokenizer))
    assert sum(slabs.values()) == sum(parts.values()) and len(optimizers) == 2  # (the policy's and the critic's)
    shutil.copytree(tmp_path / "offloaded", tmp_path / "resumed")
    _, resumed = train("resumed", True, resume=pt.checkpoints(tmp_path / "resumed")[0])
    for run in (offloaded, resumed):
        for model in ("policy", "critic"):
            ours, theirs = getattr(resident, model).state_dict(), getattr(run, model).state_dict()
            assert ours.keys() == theirs.keys()
            for name, weight in ours.items():
                assert torch.equal(weight, theirs[name]), ("resumed" if run is resumed else "offloaded", model, name)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # (peft's from_pretrained)
def test_lora_trains_only_adapters_and_the_value_head_over_one_base_that_is_the_reference_bit_for_bit(tmp_path,
                                                                                                      monkeypatch):
    """--lora-rank: the policy and the critic train fp32 adapters (and the value head) over one frozen base, the same
    tensors; the reference is that base with no adapter, to the bit; the sampler and policy/ get base + alpha/r B A;
    policy_adapter/ loads with peft onto the base and gives policy/'s weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    write_reward_module(tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = pt.make_config(lora_rank=4, lora_alpha=8.0, demo_hidden=32, demo_layers=1, demo_warmup_steps=0, steps=2,
                         batch_size=16, minibatches=2, response_length=6, reward="count_ones:score", eval_size=40,
                         sample_every=0, lr=3e-2, critic_lr=3e-2, device="cpu", demo_cache=str(tmp_path / "cache"))
    run = pt.setup(cfg)
    frozen = {n: p.clone() for m in (run.policy, run.critic) for n, p in m.named_parameters() if not p.requires_grad}
    trained = {n: p.clone() for m in (run.policy, run.critic) for n, p in m.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in trained if not n.startswith("head")) and "head.weight" in trained
    critic_adapters = {p.data_ptr() for n, p in run.critic.named_parameters() if "lora_" in n and p.requires_grad}
    assert critic_adapters and critic_adapters.isdisjoint(p.data_ptr() for p in run.policy.parameters())  # its own
    shared = {p.data_ptr() for p in run.reference.policy.parameters()}  # one base, three trees
    assert all(p.data_ptr() in shared for m in (run.policy, run.critic) for p in m.parameters() if not p.requires_grad)
    for out in ("run", "again"):
        (tmp_path / out).mkdir()
    pt.train(cfg, run, str(tmp_path / "run"), threaded=False)
    after = {n: p for m in (run.policy, run.critic) for n, p in m.named_parameters()}
    assert all(torch.equal(after[n], p) for n, p in frozen.items())  # the base: untouched
    assert all(not torch.equal(after[n], p) for n, p in trained.items() if "lora_B" in n or n == "head.weight")
    base = pt.build_demo_policy(run.tokenizer, cfg.seed, 32, 1).eval()  # the same initial weights, built anew
    batch = demo_rollout(run.tokenizer, base, ["1+2=", "30+45=", "7+7="])
    reference, _ = pt.rollout_logprobs(run.reference, batch, cfg)
    policy, _ = pt.rollout_logprobs(run.policy, batch, cfg)
    assert torch.equal(reference, pt.rollout_logprobs(base, batch, cfg)[0])  # adapters off: the base, to the bit
    assert not torch.allclose(policy, reference, atol=1e-3)  # (and the adapters do change the policy)
    merged = dict(base.named_parameters())
    for name, layer in run.policy.named_modules():
        if hasattr(layer, "lora_A"):  # W + alpha / r * B A
            merged[f"{name}.weight"] = layer.base_layer.weight + layer.lora_B["default"].weight @ \
                layer.lora_A["default"].weight * (8.0 / 4)
    t = pt.start_training(cfg, run, str(tmp_path / "again"), False, pt.Dist())  # a sampler copy, published to
    sampler = dict(t.decoder.model.named_parameters())  # (the static decoder's model)
    t.close()
    held = t.sync.sampler_flat.numel() * t.sync.sampler_flat.element_size()  # (--max-staleness 0: no staging copy)
    assert t.sync.staging is t.sync.sampler_flat and t.sync.seconds["pull"] == 0
    assert held == pt.memory_parts(cfg, torch.device("cpu"), 1, run.reference.policy, None)["sampler"]
    saved = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "policy").named_parameters())
    adapted = PeftModel.from_pretrained(pt.build_demo_policy(run.tokenizer, cfg.seed, 32, 1), tmp_path / "run" /
                                        "policy_adapter").merge_and_unload()
    for name, weight in merged.items():
        assert torch.allclose(sampler[name], weight, rtol=0, atol=1e-6), name
        assert torch.equal(saved[name], sampler[name]), name  # (fp32 on a CPU: the same numbers)
        assert torch.allclose(dict(adapted.named_parameters())[name], weight, rtol=0, atol=1e-6), name


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning", "ignore:fan_in_fan_out:UserWarning")
@pytest.mark.parametrize("family", ["llama-tied", "qwen2", "gpt2"])
def test_lora_publishes_peft_merge_in_the_samplers_order(tokenizer, family):
    """merged_weights (what a publish sends the sampler, and policy/) against peft's own merge_and_unload: a tied
    Llama (each weight once), a Qwen2 (biases) and a GPT-2 (Conv1D: fan_in_fan_out), name by name in the order of the
    sampler's flat buffer."""
    import copy
    from transformers import Qwen2Config, Qwen2ForCausalLM
    if family == "qwen2":
        torch.manual_seed(0)
        policy = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, intermediate_size=64))
    else:
        policy = tiny_llama(len(tokenizer), tie_word_embeddings=True) if family == "llama-tied" else \
            tiny_gpt2(len(tokenizer))
    lora, reference, _ = pt.lora_models(policy.float().eval(), pt.Config(lora_rank=4, device="cpu"), torch.float32)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()  # (peft starts B at 0: its merge would be the base)
    sampler, _ = pt.sampler_copy(reference, torch.float32)
    expected = copy.deepcopy(lora).merge_and_unload()
    with torch.no_grad():
        merged = list(pt.merged_weights(policy))
    assert len(merged) == len(list(sampler.parameters())) == len(list(expected.parameters()))
    for (name, p), w, (name_, e) in zip(sampler.named_parameters(), merged, expected.named_parameters()):
        assert name == name_ and w.shape == p.shape, (name, name_)
        torch.testing.assert_close(w, e, rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(w, p) for w, p in zip(merged, reference.parameters()))  # (the adapters count)


def tied_lora_bf16(tmp_path, tokenizer, monkeypatch, *flags):
    """The config of a --lora-rank --bf16 run over a tied-embedding model (as Qwen2.5-0.5B), in tmp_path with its
    prompts and reward module."""
    write_reward_module(tmp_path)
    monkeypatch.chdir(tmp_path)
    tiny_llama(len(tokenizer), dtype=torch.float32, tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
    tokenizer.save_pretrained(tmp_path / "tied")
    (tmp_path / "p.jsonl").write_text("".join(f'{{"prompt": "{a}+{a}="}}\n' for a in range(16)))
    return pt.parse_config([*TINY, "--model", str(tmp_path / "tied"), "--prompts", "p.jsonl", "--no-chat-template",
                            "--reward", "count_ones:score", "--response-length", "4", "--bf16", "--lora-rank", "4",
                            *flags])


@pytest.mark.skipif(not pt.native_bf16(torch.device("cpu")), reason="this CPU has no bf16 matmuls (AVX512-BF16, AMX)")
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # (peft)
def test_lora_bf16_over_a_tied_embedding_trains_and_its_sampler_is_one_bf16_buffer(tmp_path, tokenizer, monkeypatch):
    """--lora-rank --bf16 over a model whose output head is its embedding (as Qwen2.5-0.5B): the fp32 log-prob head
    makes the embedding fp32 too, so the frozen reference scores under autocast as the trainer does (without, its bf16
    layers met fp32 embeddings), and the sampler is one bf16 buffer (it was fp32 whole: twice the memory line)."""
    cfg = tied_lora_bf16(tmp_path, tokenizer, monkeypatch)
    run = pt.setup(cfg)
    assert run.policy.get_input_embeddings().weight.dtype == torch.float32  # (tied to the fp32 head)
    for out in ("run", "again"):
        (tmp_path / out).mkdir()
    assert len(pt.train(cfg, run, str(tmp_path / "run"), threaded=False)) == 3  # (it ran: the reference scored)
    t = pt.start_training(cfg, run, str(tmp_path / "again"), False, pt.Dist())
    t.close()
    held = t.sync.sampler_flat.numel() * t.sync.sampler_flat.element_size()
    assert t.sync.sampler_flat.dtype == torch.bfloat16 and t.sync.staging is t.sync.sampler_flat
    assert held == pt.memory_parts(cfg, torch.device("cpu"), 1, run.reference.policy, None)["sampler"]


@pytest.mark.skipif(not pt.native_bf16(torch.device("cpu")), reason="this CPU has no bf16 matmuls (AVX512-BF16, AMX)")
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # (peft)
def test_lora_bf16_reference_is_the_base_to_the_bit_through_full_logits_too(tmp_path, tokenizer, monkeypatch):
    """--lora-rank --bf16 --full-logits (as Gemma-2's soft cap or a head with a bias take): the reference's tree
    computes the fp32 head it shares with the policy outside autocast as the policy's does (it computed it in bf16: a
    KL from the first step), so with the adapters at zero their log-probs agree to the bit."""
    cfg = tied_lora_bf16(tmp_path, tokenizer, monkeypatch, "--full-logits")
    run = pt.setup(cfg)
    t = pt.start_training(cfg, run, str(tmp_path), False, pt.Dist())
    t.close()
    ids, mask = pt.left_pad(pt.format_prompts(tokenizer, ["1+2=", "37+45="], False, 64), tokenizer.pad_token_id, "cpu")
    batch = pt.generate(t.decoder.model, ids, mask, max_new_tokens=4, temperature=1.0, stop_ids=tokenizer.eos_token_id,
                        pad_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), pt.autocast(cfg, torch.device("cpu")):  # (as score_frozen and the update)
        reference, policy = (pt.rollout_logprobs(m, batch, cfg)[0] for m in (run.reference, t.actor))
    assert torch.equal(reference, policy)


def test_model_directory_prompts_file_and_reward_function(tmp_path, tokenizer):
    """--model DIR (with a chat template) + --prompts JSONL + --reward module:function, through the real CLI."""
    import copy
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}={% endif %}")
    model = tiny_llama(len(tok) + 8, dtype=torch.float32)  # spare embedding rows, as many real vocabularies have
    model.save_pretrained(tmp_path / "policy_in")
    tok.save_pretrained(tmp_path / "policy_in")
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for a in range(20):
            f.write(json.dumps({"prompt": f"{a}+{a}"}) + "\n")
    (tmp_path / "my_rewards.py").write_text(
        "def score(prompts, completions):\n"
        "    assert all('=' not in p for p in prompts)  # raw prompts, before the chat template\n"
        "    return [float(len(c)) for c in completions]\n")
    out = run_script([*TINY, "--model", str(tmp_path / "policy_in"), "--prompts", str(tmp_path / "prompts.jsonl"),
                      "--reward", "my_rewards:score", "--response-length", "5", "--no-bf16",  # (fp32: the check below)
                      "--output-dir", str(tmp_path / "run")], tmp_path)
    assert "zero-initialised head" in out
    assert "preset --model: --task '', --temperature 1.0, --ppo-epochs 1, --lr 1e-06, --critic-lr 1e-05\n" in out
    records = check_outputs(tmp_path / "run", 3)
    assert "eval_accuracy" not in records[-1]
    assert all(r["response_tokens"] <= 16 * 5 for r in records)
    # the trainer scores the distribution the sampler drew from (ids of the tokenizer only, not the spare rows)
    assert all(r["behav_prox_max_diff"] < 1e-5 for r in records)


def test_a_tokenizer_without_pad_and_a_reward_model_of_the_same_vocabulary(tmp_path, tokenizer):
    """As Llama 3 base: no pad token, so ensure_pad_token adds one past the reward model's (and so the critic's)
    embedding; neither may ever read it, and the policy may never sample it."""
    import copy
    from transformers import LlamaConfig, LlamaForSequenceClassification
    tok = copy.deepcopy(tokenizer)
    tok.pad_token = None
    tiny_llama(len(tok), dtype=torch.float32).save_pretrained(tmp_path / "policy_in")
    rm = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=64, num_labels=1))
    for path, model in (("policy_in", None), ("rm", rm)):
        if model is not None:
            model.save_pretrained(tmp_path / path)
        tok.save_pretrained(tmp_path / path)
    with open(tmp_path / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": f"{a}+{a * 37}="}) + "\n" for a in range(20))  # ragged: left pads
    run_script([*TINY, "--model", str(tmp_path / "policy_in"), "--prompts", str(tmp_path / "prompts.jsonl"),
                "--reward-model", str(tmp_path / "rm"), "--response-length", "5",
                "--output-dir", str(tmp_path / "run")], tmp_path)
    records = check_outputs(tmp_path / "run", 3)
    assert all(math.isfinite(r["reward_mean"]) for r in records)


def bench_workload(directory, seed=0, shape="small", prompt_words=32):
    """The CPU speed workload of the README (issue 23): policy/ (a random Llama, hidden 256 x 4 layers, vocab 512),
    rm/ (a LlamaForSequenceClassification of the same vocabulary, so the critic starts from it) and prompts.jsonl
    (prompts of 32 words, a token each; no BOS). Usage: python -c "from test_ppo_tokens import bench_workload;
    bench_workload('wl')".
    shape="0.5B": the GPU workload, Qwen2.5-0.5B's shape (hidden 896 x 24 layers, 14 / 2 heads, vocab 151,936, tied
    embeddings, attention biases: on o_proj too, unlike Qwen2) as a Llama (AutoTokenizer would give a qwen2 config
    Qwen2Tokenizer), saved in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
    big = shape == "0.5B"
    tok = word_tokenizer(151936 if big else 512)
    config = dict(vocab_size=len(tok), hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, intermediate_size=688, max_position_embeddings=128, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if big:
        config.update(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      intermediate_size=4864, max_position_embeddings=4096, tie_word_embeddings=True,
                      attention_bias=True, rope_theta=1e6)
    torch.manual_seed(seed)
    built = {"policy": LlamaForCausalLM(LlamaConfig(**config)),
             "rm": LlamaForSequenceClassification(LlamaConfig(**config, num_labels=1))}
    for name, model in built.items():
        model.to(torch.bfloat16 if big else torch.float32).save_pretrained(os.path.join(directory, name))
        tok.save_pretrained(os.path.join(directory, name))
    word_prompts(os.path.join(directory, "prompts.jsonl"), len(tok), prompt_words, seed)


def word_tokenizer(n: int):  # a tokenizer of n words: <pad>, <bos>, <eos>, <unk>, w0, w1, ...; no BOS added
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<pad>", "<bos>", "<eos>", "<unk>", *(f"w{i}" for i in range(n - 4))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")


def word_prompts(path, n: int, words: int, seed=0):  # 256 prompts of `words` random words of word_tokenizer(n)
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(256):
            ids = torch.randint(4, n, (words,), generator=g).tolist()
            f.write(json.dumps({"prompt": " ".join(f"w{i - 4}" for i in ids)}) + "\n")


QWEN25 = {  # Qwen2.5's shapes (as Llamas): hidden, layers, attention heads, KV heads, MLP width, vocabulary, tied
    "0.5B": (896, 24, 14, 2, 4864, 151936, True), "1.5B": (1536, 28, 12, 2, 8960, 151936, True),
    "3B": (2048, 36, 16, 2, 11008, 151936, True), "7B": (3584, 28, 28, 4, 18944, 152064, False),
    "14B": (5120, 48, 40, 8, 13824, 152064, False)}
MEMORY_RUNS = {"full": [], "lora": ["--lora-rank", "16"], "lora-offload": ["--lora-rank", "16", "--offload"]}
MEMORY_FLAGS = ["--batch-size", "64", "--response-length", "256", "--steps", "3", "--no-chat-template", "--bf16",
                "--gradient-checkpointing", "--micro-batch-size", "8", "--sample-every", "0", "--seed", "1"]
RANDOM_WEIGHTS = """import sys, torch, transformers
sys.path.insert(0, {here!r})
import ppo_tokens
def built(auto, **config):  # from_pretrained -> the config's model, random weights made on the device (no file)
    def load(path, dtype=None, **_):
        with torch.device({device!r}):
            return auto.from_config(transformers.AutoConfig.from_pretrained(path, **config), dtype=dtype)
    return load
transformers.AutoModelForCausalLM.from_pretrained = built(transformers.AutoModelForCausalLM)
transformers.AutoModelForSequenceClassification.from_pretrained = built(
    transformers.AutoModelForSequenceClassification, num_labels=1)
ppo_tokens.save_policy = lambda t, path: None  # (what is measured is the run, not writing a 14B model's 28 GB)
ppo_tokens.main(sys.argv[1:])
"""


def bench_memory(directory, runs=tuple(MEMORY_RUNS), device="cuda", shapes=QWEN25, flags=MEMORY_FLAGS, budget_s=540,
                 out=None):
    """Issue 40's GPU benchmark in one command. For each of `runs` (full fine-tuning, LoRA, LoRA + offload) the shapes
    from the largest down, through the real entry point (python ppo_tokens.py, 64 rows of 128 + 256 tokens, 3
    iterations, a critic and a reward model of the policy's shape), until one completes: a shape whose memory line
    does not fit is refused before any weight exists (its line kept), one that runs out of memory is noted. Random
    weights are made on the device by the child process (only configs and a tokenizer on disk). Prints, and writes to
    out/memory.json after each shape, what each did; for the one that completed: its peak device memory per iteration
    (GiB; the first's window holds the set-up) and seconds an iteration (iterations 2-3). All within budget_s (a
    device call's limit): a run cut by it is marked so. Usage (GPU), one or two runs a call: python -c "from
    test_ppo_tokens import bench_memory; bench_memory('wm', ['full', 'lora'], out='$OUT')"."""
    tok, deadline, out = word_tokenizer(151936), time.time() + budget_s, out or directory
    os.makedirs(directory, exist_ok=True)
    word_prompts(os.path.join(directory, "prompts.jsonl"), len(tok), 128)  # (no BOS: 128 tokens)
    script = os.path.join(directory, "random_weights.py")
    with open(script, "w") as f:
        f.write(RANDOM_WEIGHTS.format(here=HERE, device=device))
    from transformers import LlamaConfig  # (as bench_workload: a qwen2 config would make AutoTokenizer a Qwen2's)
    results = {}
    for run in runs:
        more, results[run] = MEMORY_RUNS[run], []
        for shape, (hidden, layers, heads, kv, mlp, vocab, tied) in reversed(shapes.items()):
            config = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=kv, intermediate_size=mlp, vocab_size=vocab, tie_word_embeddings=tied,
                          max_position_embeddings=4096, attention_bias=True, rope_theta=1e6, bos_token_id=1,
                          eos_token_id=2, pad_token_id=0)
            for name, extra in (("policy", {}), ("rm", {"num_labels": 1})):
                LlamaConfig(**config, **extra).save_pretrained(os.path.join(directory, shape, name))
                tok.save_pretrained(os.path.join(directory, shape, name))
            out_dir = os.path.join(directory, f"{run}-{shape}")
            shutil.rmtree(out_dir, ignore_errors=True)
            argv = [sys.executable, script, "--model", os.path.join(directory, shape, "policy"), "--reward-model",
                    os.path.join(directory, shape, "rm"), "--prompts", os.path.join(directory, "prompts.jsonl"),
                    "--device", device, *flags, *more, "--output-dir", out_dir]
            start = time.time()
            if deadline - start < 30:
                break
            try:
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=deadline - start)
                text, code = proc.stdout + proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as e:  # (its output: bytes, text=True or not)
                text = "".join((x or b"").decode(errors="replace") for x in (e.stdout, e.stderr))
                text, code = text + f"\ncut at the budget, after {deadline - start:.0f} s", "budget"
            line = " | ".join(x for x in text.splitlines() if x.startswith("memory on"))  # (--offload: the host's too)
            result = {"shape": shape, "flags": " ".join(more), "memory_line": line,
                      "wall_s": round(time.time() - start)}
            records = read_metrics(out_dir) if code == 0 else []
            if code == 0:
                times = [r["time_s"] for r in records if r.get("step", 0) >= 1]
                result.update(completed=True, peak_memory_gb=[r.get("peak_memory_gb") for r in records
                                                              if r.get("step", 0) >= 1],
                              peak_rss_gb=max(r["peak_rss_gb"] for r in records if "peak_rss_gb" in r),
                              s_per_iteration=round((times[-1] - times[0]) / max(1, len(times) - 1), 2))
            else:
                refused = next((x for x in text.splitlines() if "this run needs" in x), None)
                result.update(completed=False, why=refused or ("out of memory" if "out of memory" in text.lower()
                                                                 else (text.strip().splitlines() or [""])[-1]))
            print(json.dumps(result), flush=True)
            results[run].append(result)
            with open(os.path.join(out, "memory.json"), "w") as f:
                json.dump(results, f, indent=1)
            if code in (0, "budget"):
                break
    return results


# the issue-23 speed workload's flags (README), every one given: --model's defaults may change
BENCH = ["--response-length", "64", "--batch-size", "16", "--minibatches", "2", "--ppo-epochs", "1", "--temperature",
         "0.7", "--no-chat-template", "--lr", "1e-6", "--critic-lr", "1e-5", "--seed", "1", "--sample-every", "0",
         "--device", "cpu"]


def test_speed_workload_runs_with_a_critic_from_its_reward_model(tmp_path):
    """The speed workload (two iterations): prompts of 32 tokens, 64-token responses, the critic from the reward model,
    the first minibatch's ratio exactly 1."""
    bench_workload(tmp_path / "wl")
    out = run_script(["--model", tmp_path / "wl" / "policy", "--prompts", tmp_path / "wl" / "prompts.jsonl",
                      "--reward-model", tmp_path / "wl" / "rm", *BENCH, "--steps", "2",
                      "--output-dir", tmp_path / "run"], tmp_path)
    assert "critic from the reward model" in out
    records = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert len(records) == 2 and all(r["first_ratio_max_dev"] == 0.0 for r in records)
    assert all(r["padding_frac"] < 0.5 and r["response_length"] > 32 for r in records)


def write_reward_module(path):
    (path / "count_ones.py").write_text("def score(prompts, completions):\n"
                                        "    return [c.count('1') / 4 for c in completions]\n")


LOOP = ["--batch-size", "16", "--minibatches", "2", "--micro-batch-size", "8", "--steps", "4", "--response-length", "6",
        "--demo-warmup-steps", "0", "--sample-every", "0", "--reward", "count_ones:score", "--lr", "3e-3",
        "--eval-size", "40", "--device", "cpu"]  # the CPU: bit-exact assertions; their CUDA twins add --device cuda


def test_staleness_zero_with_the_thread_equals_the_synchronous_loop(tmp_path, monkeypatch):
    write_reward_module(tmp_path)
    monkeypatch.chdir(tmp_path)
    results = []
    for threaded in (False, True):
        cfg = pt.parse_config([*LOOP, "--output-dir", str(tmp_path / f"run{threaded}")])
        run = pt.setup(cfg)
        os.makedirs(cfg.output_dir)
        history = pt.train(cfg, run, cfg.output_dir, threaded=threaded)
        results.append((history, {k: v.clone() for k, v in run.policy.state_dict().items()}))
    (plain, plain_weights), (thread, thread_weights) = results
    for a, b in zip(plain, thread):
        for key in ("pg_loss", "vf_loss", "reward_mean", "kl", "approx_kl", "clipfrac", "entropy"):
            assert a[key] == b[key], (key, a[key], b[key])
    assert all(torch.equal(plain_weights[k], thread_weights[k]) for k in plain_weights)
    assert all(r["behav_prox_max_diff"] < 1e-5 for r in plain + thread)  # the sampler really had the new weights
    # ... and knew it: every token of the version it was sampled with (a publish writes the sampler's weights here)
    assert all(r["staleness_max"] == 0 and r["is_weight_max"] == 1.0 for r in plain + thread if r["step"] > 0)
    assert plain[-1]["approx_kl"] > 0 and plain[0]["reward_mean"] != plain[-1]["reward_mean"]  # it did train


def test_staleness_one_keeps_every_token_within_bounds(tmp_path):
    write_reward_module(tmp_path)
    out = run_script([*LOOP, "--steps", "6", "--max-staleness", "1", "--output-dir", str(tmp_path / "run")], tmp_path)
    records = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert all(r["staleness_max"] <= 1 for r in records) and max(r["staleness_max"] for r in records) == 1
    assert records[0]["staleness_max"] == 0 and records[0]["is_weight_mean"] == 1.0
    assert all(r["first_ratio_max_dev"] == 0.0 and r["weight_sync_ms"] >= 0 for r in records)
    assert "it    6/6" in out
    run_script([*LOOP, "--steps", "6", "--max-staleness", "2", "--output-dir", str(tmp_path / "run2")], tmp_path)
    records = [r for r in read_metrics(tmp_path / "run2") if r["step"] > 0]
    assert all(r["staleness_max"] <= 2 for r in records) and max(r["staleness_max"] for r in records) == 2


def test_the_sampler_thread_samples_with_the_newer_weights_it_pulls(tmp_path, monkeypatch):
    """--max-staleness 1: the version a batch's tokens are tagged with is the one in the sampler's weights (a sampler
    that tagged the newest version but kept version 0's weights would pass every staleness bound)."""
    write_reward_module(tmp_path)
    monkeypatch.chdir(tmp_path)
    finished = []
    monkeypatch.setattr(pt, "finish_training", finished.append)
    cfg = pt.parse_config([*LOOP, "--steps", "3", "--max-staleness", "1", "--output-dir", "run"])
    os.makedirs(cfg.output_dir)
    run = pt.setup(cfg)
    initial = torch.cat([p.detach().reshape(-1) for p in run.policy.parameters()])  # (version 0, in the buffer's order)
    pt.train(cfg, run, cfg.output_dir)
    (t,) = finished
    assert t.sync.sampler_version >= 1 and not torch.equal(t.sync.sampler_flat, initial)


def test_the_logged_reward_kl_and_explained_variance_read_the_right_rows_and_tokens(tmp_path, monkeypatch):
    """metrics.jsonl: reward_mean is the reward's own score (before the missing-EOS penalty), kl the per-sequence KL
    of the rows in the loss (not the dropped flat groups'), explained_variance over the real tokens (not the pads)."""
    write_reward_module(tmp_path)
    monkeypatch.chdir(tmp_path)
    seen, log_iteration = [], pt.log_iteration
    monkeypatch.setattr(pt, "log_iteration", lambda t, step, batch, kl, *args: (
        seen.append((batch, kl)), log_iteration(t, step, batch, kl, *args)))
    (tmp_path / "flat_first.py").write_text("def score(prompts, completions):  # the first group: always flat\n"
                                            "    return [0.0] * 4 + [c.count('1') / 4 for c in completions[4:]]\n")
    for name, flags in (("gae", ["--missing-eos-penalty", "1"]), ("rloo", ["--advantage", "rloo",
                                                                          "--samples-per-prompt", "4"])):
        seen.clear()
        cfg = pt.parse_config([*LOOP, "--steps", "2", *flags, "--output-dir", name] +
                              ["--reward", "flat_first:score"] * (name == "rloo"))
        os.makedirs(name)
        pt.train(cfg, pt.setup(cfg), name)
        records = [r for r in read_metrics(tmp_path / name) if r["step"] > 0]
        for record, (batch, kl) in zip(records, seen, strict=True):
            real, rows = batch.response_mask.bool(), batch.loss_mask.any(1)
            assert record["reward_mean"] == pytest.approx(float(batch.raw_scores.mean()))
            assert record["kl"] == pytest.approx(float(kl.double().sum(-1)[rows].mean()), rel=1e-5, abs=1e-6)
            if name == "gae":
                r, v = batch.returns[real], batch.values[real]
                assert record["explained_variance"] == pytest.approx(float(1 - (r - v).var() / r.var()))
        cases = [(b.raw_scores != b.scores).any() and not b.response_mask.all() for b, _ in seen] if name == "gae" \
            else [not b.loss_mask.any(1).all() and kl.abs().sum() > 0 for b, kl in seen]
        assert any(cases)  # (the test can fail: penalised rows and pads; rows out of the loss)


def load_into_fresh_models(checkpoint):  # what --resume does, into models built from the checkpoint's config
    cfg = pt.Config(**json.load(open(os.path.join(checkpoint, "config.json"))))
    tokenizer = pt.build_demo_tokenizer()
    policy = pt.build_demo_policy(tokenizer, 0, cfg.demo_hidden, cfg.demo_layers)
    critic, actor = pt.build_critic(policy), pt.Actor(policy, cfg.temperature)
    policy_opt, critic_opt, schedules = pt.make_optimizers(cfg, actor, critic)
    state = pt.load_checkpoint(checkpoint, actor, critic, (policy_opt, critic_opt), schedules)
    assert all(torch.isfinite(p).all() for p in [*policy.parameters(), *critic.parameters()])
    assert [s.last_epoch for s in schedules] == [state["step"]] * 2 and len(policy_opt.state) > 0  # (both decay)
    return state


def test_sampler_errors_and_sigterm_stop_the_run_without_a_hung_thread(tmp_path, monkeypatch):
    import signal
    import threading
    (tmp_path / "flaky.py").write_text("calls = 0\ndef score(prompts, completions):\n    global calls\n    calls += 1\n"
                                       "    if calls == 3:\n        raise ValueError('reward service down')\n"
                                       "    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    args = [a if a != "count_ones:score" else "flaky:score" for a in LOOP]
    cfg = pt.parse_config([*args, "--max-staleness", "2", "--steps", "8", "--output-dir", str(tmp_path / "run")])
    os.makedirs(cfg.output_dir)
    with pytest.raises(SystemExit, match="reward service down"):
        pt.train(cfg, pt.setup(cfg), cfg.output_dir)
    assert not any(t.name == "ppo_tokens-sampler" for t in threading.enumerate())
    write_reward_module(tmp_path)
    proc = subprocess.Popen([sys.executable, SCRIPT, *LOOP, "--steps", "100000", "--max-staleness", "1",
                             "--output-dir", str(tmp_path / "run2")], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:  # (whatever fails here, the child does not outlive the test: it would hold a core for the rest of the suite)
        seen = False
        for line in proc.stdout:
            if line.startswith("it    2/"):
                seen = True
                break
        assert seen, "the run did not reach iteration 2"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    # stopped promptly, with a checkpoint: after the iteration the signal came in (at most one more "it" line), and the
    # sampler thread joined (not left behind by close()'s timeout); counted in iterations, not in seconds
    after = out[out.index("SIGTERM: finishing this iteration"):]
    assert proc.returncode == 0 and after.count("\nit ") <= 1 and "did not stop" not in out, out[-2000:]
    (checkpoint,) = pt.checkpoints(tmp_path / "run2")
    assert "stopped by SIGTERM after iteration" in out and f"--resume {checkpoint}" in out
    state = load_into_fresh_models(checkpoint)
    assert state["step"] >= 2 and not any(t.name == "ppo_tokens-sampler" for t in threading.enumerate())
    assert state["prompts_drawn"] == 16 * state["step"]  # the trained batches' prompts, not the sampler's run-ahead


@slow
def test_critic_free_runs_sample_groups_hold_no_critic_and_resume_to_the_same_weights(tmp_path):
    from safetensors.torch import load_file
    (tmp_path / "grouped.py").write_text(
        "import os, signal\ncalls = 0\ndef score(prompts, completions):\n    global calls\n    calls += 1\n"
        "    assert all(p == prompts[i - i % 4] for i, p in enumerate(prompts)), prompts  # groups of 4\n"
        "    assert len(set(prompts)) == len(prompts) // 4, prompts\n"
        "    if calls == int(os.environ.get('KILL_AT', '0')):\n        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return [c.count('1') / 4 for c in completions]\n")
    args = [a if a != "count_ones:score" else "grouped:score" for a in LOOP]
    args += ["--advantage", "grpo", "--samples-per-prompt", "4", "--save-every", "1", "--dynamic-sampling", "2"]
    out = run_script([*args, "--output-dir", str(tmp_path / "full")], tmp_path)
    assert "no critic (--advantage grpo)" in out and "trainable parameters: " in out
    killed = run_raw([*args, "--output-dir", str(tmp_path / "part")], tmp_path, KILL_AT="3")  # in a later iteration
    assert killed.returncode == -9
    run_script(["--resume", str(tmp_path / "part")], tmp_path)
    full = load_file(tmp_path / "full/policy/model.safetensors")
    part = load_file(tmp_path / "part/policy/model.safetensors")
    assert full.keys() == part.keys() and all(torch.equal(full[k], part[k]) for k in full)
    assert not any(k.startswith("critic") for k in saved_keys(pt.checkpoints(tmp_path / "full")[-1]))
    records = [r for r in read_metrics(tmp_path / "full") if r["step"] > 0]
    assert all("vf_loss" not in r and "explained_variance" not in r for r in records)
    assert all(r["kl_loss"] >= 0 and r["zero_std_groups"] >= 0 for r in records)
    assert all(r["sampling_rounds"] >= 1 for r in records) and any(r["sampling_rounds"] > 1 for r in records)


# ---------------------------------------------------------------------------------------------------------------
# PLUMBING, as in ppo_tokens.py: set-up and models (dropout off, the critic's start, hybrid models, the fast sampler
# against the plain loop, grouped decode attention, flash-attn detection)


def test_dropout_is_off_in_every_model():
    model = tiny_llama(16, attention_dropout=0.5, dtype=torch.float32).train()
    mlp = model.model.layers[0].mlp
    mlp.add_module("drop", torch.nn.Dropout(0.5))  # a dropout module too

    def forward_with_dropout(x):  # LlamaMLP.forward, then the dropout
        return mlp.drop(mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)))

    mlp.forward = forward_with_dropout
    x = torch.randint(0, 16, (2, 8))
    assert not torch.equal(model(x).logits, model(x).logits)  # dropout active: the test can fail
    pt.disable_dropout(model)
    assert torch.equal(model(x).logits, model(x).logits)  # still in train mode, now deterministic
    assert model.config.attention_dropout == 0.0


def test_critic_starts_at_zero_or_from_the_reward_model(tokenizer):
    policy = tiny_llama(len(tokenizer), dtype=torch.float32)
    critic = pt.build_critic(policy)
    ids, mask = pt.left_pad([[1, 5, 6], [1, 7]], tokenizer.pad_token_id, "cpu")
    assert (critic(ids, mask, pt.positions(mask)) == 0).all()  # zero head: first advantages are the rewards
    assert all(p.requires_grad for p in critic.parameters())
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(critic.backbone.parameters(), policy.model.parameters()))
    rm = pt.ScalarHeadModel(tiny_llama(len(tokenizer), seed=5, dtype=torch.float32).model,
                            torch.nn.Linear(32, 1, bias=False))
    from_rm = pt.build_critic(policy, rm, same_tokenizer=True)
    torch.testing.assert_close(from_rm(ids, mask, pt.positions(mask)), rm(ids, mask, pt.positions(mask)))
    assert (pt.build_critic(policy, rm, same_tokenizer=False)(ids, mask, pt.positions(mask)) == 0).all()


def test_hybrid_models_sample_with_their_own_cache_and_scoring_agrees(tokenizer):
    """Falcon-H1 (Mamba-2 and attention layers side by side): the plain loop lets the model build its hybrid cache
    (a bare DynamicCache crashed with an IndexError), and its logit multiplier rules out the fused head."""
    from transformers import FalconH1Config, FalconH1ForCausalLM
    torch.manual_seed(0)
    policy = FalconH1ForCausalLM(FalconH1Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                head_dim=16, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
                                                mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=4,
                                                lm_head_multiplier=0.5, max_position_embeddings=64)).double().eval()
    assert not pt.fused_head_agrees(policy)
    batch = demo_rollout(tokenizer, policy, ["1+2=", "37+45=", "9+90="], T=5)  # ragged: left-padded prompts
    logprobs, _ = pt.sequence_logprobs(policy, *pt.full_sequence(batch), batch.response, batch.response_mask, 1.0,
                                       full_logits=True)
    torch.testing.assert_close(logprobs, batch.behav_logprobs, rtol=0, atol=1e-8)


@pytest.mark.parametrize("family,dtype,top_k,compiled", [("llama", torch.float64, 0, False),
                                                         ("llama", torch.float32, 5, False),
                                                         ("gpt2", torch.float64, 0, False),
                                                         ("sliding", torch.float64, 0, False),
                                                         pytest.param("llama", torch.float32, 0, True, marks=slow)])
def test_fast_sampler_gives_the_plain_loops_tokens_and_logprobs(tokenizer, family, dtype, top_k, compiled, capsys,
                                                               monkeypatch):
    if family == "sliding":  # a window shorter than the cache: refused, the plain loop samples (its own masks)
        monkeypatch.delenv("PPO_TOKENS_STRICT")  # (which is an error under the strict switch)
        from transformers import MistralConfig, MistralForCausalLM
        torch.manual_seed(2)
        policy = MistralForCausalLM(MistralConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                                  sliding_window=8)).eval()  # (wider than the check's 5 columns)
    else:
        policy = (tiny_gpt2 if family == "gpt2" else tiny_llama)(len(tokenizer), seed=2)
    policy = policy.to(dtype)
    texts = ["1+2=", "37+45=", "9+90=", "5+5=", "123+4=", "0+0="]  # ragged prompts: left padding in every batch
    ids, mask = pt.left_pad(pt.format_prompts(tokenizer, texts, False, 64), tokenizer.pad_token_id, "cpu")
    # compiled: for the sampler thread's one intra-op thread, as train() compiles it for a threaded CPU run
    decoder = pt.fast_decoder(policy, len(texts), ids.shape[1] + 12, pt.PlainDecoder, compiled=compiled,
                              threads=1 if compiled else 0)
    out = capsys.readouterr().out
    assert type(decoder) is (pt.PlainDecoder if family == "sliding" else pt.StaticDecoder)
    assert ("fast sampler off for MistralForCausalLM (sliding-window layers" in out) == (family == "sliding")
    assert "torch.compile off" not in out
    assert (family != "sliding" and decoder.decode is not policy and decoder.prefill is not policy) == compiled
    sampling = dict(max_new_tokens=10, temperature=0.9, stop_ids=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                    top_k=top_k)

    def sample(sampler):  # from the same seed each time
        return pt.generate(sampler, ids, mask, **sampling, generator=torch.Generator().manual_seed(7))

    def in_a_sampler_thread():  # one intra-op thread, like the Producer's: the compiled code runs, not a recompile
        torch.set_num_threads(1)
        batches.extend(sample(decoder) for _ in range(2))
        # then capture()'s warm-up prompt (on CUDA), as fast_decoder calls it: 2 tokens, not a length-1 prefill the
        # compile specialises on
        with torch.no_grad():
            decoder.warm_up()

    batches = [sample(policy)]
    if compiled:
        from torch._dynamo.utils import counters
        graphs = counters["stats"]["unique_graphs"]
        thread = threading.Thread(target=in_a_sampler_thread)
        thread.start()
        thread.join()
        assert counters["stats"]["unique_graphs"] == graphs
    else:
        batches += [sample(decoder), sample(decoder)]  # the decoder twice: its cache is reused between batches
    assert not batches[0].response_mask.all()  # some rows ended early: pads after EOS
    for fast in batches[1:]:
        assert torch.equal(fast.response, batches[0].response)
        assert torch.equal(fast.response_mask, batches[0].response_mask)
        # the same tokens; the log-probs differ only by the attention's rounding over the longer preallocated cache
        torch.testing.assert_close(fast.behav_logprobs, batches[0].behav_logprobs, rtol=0,
                                   atol=1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_groups_shared_prompt_is_prefilled_once_and_samples_the_plain_loops_tokens(tokenizer, family):
    """--samples-per-prompt: the fast sampler prefills one row per group and copies its cache to the group's others;
    a batch whose rows do not repeat in groups prefills every row. Both sample what the plain loop samples."""
    policy = (tiny_gpt2 if family == "gpt2" else tiny_llama)(len(tokenizer), seed=2)
    grouped = [t for t in ["1+2=", "37+45=", "123+4="] for _ in range(4)]  # 3 groups of 4, ragged: left padding
    rng = torch.get_rng_state()
    decoder = pt.fast_decoder(policy, len(grouped), 20, pt.PlainDecoder, group=4)
    assert decoder.shared is not None and torch.equal(torch.get_rng_state(), rng)  # (its checks: their own generator)
    forwards = []  # the (rows, columns) of each model call: a prefill has more than one column
    hook = policy.register_forward_pre_hook(lambda m, a, kw: forwards.append(tuple(kw["input_ids"].shape)),
                                            with_kwargs=True)
    for texts, prefill_rows in ((grouped, 3), (grouped[::4] + grouped[1::4] + grouped[2::4] + grouped[3::4], 12)):
        ids, mask = pt.left_pad(pt.format_prompts(tokenizer, texts, False, 64), tokenizer.pad_token_id, "cpu")
        batches = []
        for sampler in (policy, decoder):
            forwards.clear()
            batches.append(pt.generate(sampler, ids, mask, max_new_tokens=8, temperature=0.9,
                                       pad_id=tokenizer.pad_token_id, stop_ids=tokenizer.eos_token_id,
                                       generator=torch.Generator().manual_seed(7)))
        assert [f for f in forwards if f[1] > 1] == [(prefill_rows, ids.shape[1])]  # the decoder's one prefill
        assert torch.equal(batches[1].response, batches[0].response)
        torch.testing.assert_close(batches[1].behav_logprobs, batches[0].behav_logprobs, rtol=0, atol=1e-12)
    hook.remove()


def test_the_shared_prefill_check_allows_the_unshared_prefills_own_row_count_noise(tokenizer, monkeypatch):
    policy = tiny_llama(len(tokenizer), seed=2, dtype=torch.float32).requires_grad_(False)
    decoder = pt.fast_decoder(policy, 8, 20, pt.PlainDecoder, group=4)
    assert decoder.shared is not None
    monkeypatch.setattr(kernels, "agrees_with_plain_loop", lambda *args: None)  # the cache comparison alone

    def row_count_noise(module, args, kwargs, output):  # an 8-row prefill's keys 10% off a 2-row one's (bf16 GEMMs
        if kwargs["input_ids"].shape == (8, 3):  # differ with the row count; 10%: beyond a fixed tolerance of 0.02)
            for layer in kwargs[decoder.cache_kwarg].layers:
                layer.keys.mul_(1.1)
    hook = policy.register_forward_hook(row_count_noise, with_kwargs=True)
    kernels.share_prefill_checked(decoder, policy, 8, pt.PlainDecoder, "Llama")  # (strict: an error if it fell back)
    hook.remove()
    shared, repeat_cache_rows = decoder.shared, kernels.repeat_cache_rows
    assert shared is not None

    def misplaced(source, target, group):  # a copy one row off
        repeat_cache_rows(source, target, group)
        for layer in target.layers:
            layer.keys.copy_(layer.keys.roll(1, 0))
    monkeypatch.setattr(kernels, "repeat_cache_rows", misplaced)
    with pytest.raises(RuntimeError, match="shared prefill off for Llama \\(its cache differs"):
        kernels.share_prefill_checked(decoder, policy, 8, pt.PlainDecoder, "Llama")
    assert decoder.shared is None
    decoder.shared = shared

    def nan(source, target, group):  # a copy that leaves a NaN (a comparison with NaN is False: it passed)
        repeat_cache_rows(source, target, group)
        target.layers[0].keys[1, 0, 0, 0] = float("nan")
    monkeypatch.setattr(kernels, "repeat_cache_rows", nan)
    with pytest.raises(RuntimeError, match="shared prefill off for Llama \\(its cache differs .* by nan"):
        kernels.share_prefill_checked(decoder, policy, 8, pt.PlainDecoder, "Llama")

    monkeypatch.undo()  # (agrees_with_plain_loop itself)

    class NaNStep(pt.PlainDecoder):  # and a decoder whose logits hold a NaN
        def step(self, token):
            logits = super().step(token).clone()
            logits[1, 7] = float("nan")
            return logits
    with pytest.raises(ValueError, match="differ from the plain loop's by nan"):
        kernels.agrees_with_plain_loop(NaNStep(policy), policy, 8, pt.PlainDecoder)


@slow
def test_a_compiled_shared_prefill_does_not_recompile_in_the_sampler_thread(tokenizer):
    """One row per group (a rank's rows = --samples-per-prompt): the shared prefill's 1-row batch is compiled at
    start-up under the sampler thread's one intra-op thread, so the thread's batches run the compiled code as they
    are."""
    from torch._dynamo.utils import counters
    policy = tiny_llama(len(tokenizer), seed=2, dtype=torch.float32)
    decoder = pt.fast_decoder(policy, 4, 20, pt.PlainDecoder, compiled=True, threads=1, group=4)
    assert decoder.shared is not None and decoder.prefill is not policy
    ids, mask = pt.left_pad(pt.format_prompts(tokenizer, ["37+45="] * 4, False, 64), tokenizer.pad_token_id, "cpu")
    graphs = counters["stats"]["unique_graphs"]

    def in_a_sampler_thread():  # one intra-op thread, like the Producer's
        torch.set_num_threads(1)
        for _ in range(2):
            pt.generate(decoder, ids, mask, max_new_tokens=5, temperature=1.0, stop_ids=tokenizer.eos_token_id,
                        pad_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0))

    thread = threading.Thread(target=in_a_sampler_thread)
    thread.start()
    thread.join()
    assert counters["stats"]["unique_graphs"] == graphs


def test_grouped_decode_attention_equals_sdpa_with_repeated_kv():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, n, 8, generator=g, dtype=torch.float64) for h, n in ((6, 1), (2, 9), (2, 9)))
    mask = torch.rand(3, 1, 1, 9, generator=g) > 0.3
    mask[:, :, :, 0] = True  # (no fully masked row)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)  # repeats K/V 3 times
    grouped, _ = kernels.ppo_attention(module, q, k, v, mask, grouped_decode=True, scaling=0.3)
    assert grouped.shape == expected.shape == (3, 1, 6, 8)
    torch.testing.assert_close(grouped, expected, rtol=0, atol=1e-12)


def test_flash_attn_is_imported_to_detect_it_and_packing_is_checked_under_autocast(tmp_path, monkeypatch, capsys):
    (tmp_path / "flash_attn").mkdir()  # installed (find_spec sees it) but built for another torch
    (tmp_path / "flash_attn/__init__.py").write_text("raise ImportError('undefined symbol: _ZN3c10...')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PPO_TOKENS_STRICT")
    kernels.flash_attn_varlen.cache_clear()
    try:
        assert kernels.flash_attn_varlen() is None
        assert "flash-attn is installed but does not import" in capsys.readouterr().out
        kernels.flash_attn_varlen.cache_clear()
        monkeypatch.setenv("PPO_TOKENS_STRICT", "1")
        with pytest.raises(RuntimeError, match="PPO_TOKENS_STRICT=1: flash-attn is installed"):
            kernels.flash_attn_varlen()
    finally:
        kernels.flash_attn_varlen.cache_clear()
        sys.modules.pop("flash_attn", None)
    policy = tiny_llama(16, dtype=torch.float32)
    assert pt.use_packed_attention(policy.model, bf16=True) == ""  # packed == padded in fp32 and under bf16 autocast
    # a packed path that only goes wrong under autocast (as a broken flash-attn would)
    attention = kernels.ppo_attention

    def broken(module, query, *args, packed_layout=None, **kwargs):
        out, _ = attention(module, query, *args, packed_layout=packed_layout, **kwargs)
        return (out.flip(1) if packed_layout is not None and torch.is_autocast_enabled("cpu") else out), None
    monkeypatch.setattr(kernels, "ppo_attention", broken)  # (use_ppo_attention registers it)
    try:
        assert pt.use_packed_attention(policy.model, bf16=False) == ""
        assert "LlamaModel cannot run packed (hidden states under --bf16" in pt.use_packed_attention(policy.model, True)
    finally:
        monkeypatch.undo()
        kernels.use_ppo_attention(policy.model)  # the real one registered again, for the other tests


def test_a_critic_free_run_packs_its_micro_batches(tmp_path):  # (without a critic there is no critic to check)
    cfg = pt.make_config(advantage="grpo", micro_batch_tokens=64, demo_warmup_steps=0, eval_size=40, device="cpu",
                         demo_cache=str(tmp_path))
    run = pt.setup(cfg)
    assert run.critic is None and (cfg.micro_batch_tokens, cfg.micro_batch_size) == (64, 0)


def test_packed_micro_batches_that_disagree_fall_back_to_padded_ones_that_train(tmp_path, monkeypatch):
    right_padded = kernels._right_padded

    def shifted(x, layout):  # a packed path that attends to the wrong positions
        return right_padded(x, layout).roll(1, dims=2)
    monkeypatch.setattr(kernels, "_right_padded", shifted)
    args = [*TINY, "--steps", "2", "--save-every", "1", "--micro-batch-size", "0", "--micro-batch-tokens", "40"]
    with pytest.raises(RuntimeError, match="PPO_TOKENS_STRICT=1: --micro-batch-tokens off: LlamaModel cannot run "
                                           "packed \\(hidden states [0-9.]+ from padded ones, over 4x"):
        run_main([*args, "--output-dir", tmp_path / "strict"], tmp_path)
    monkeypatch.delenv("PPO_TOKENS_STRICT")
    out = run_script([*args, "--output-dir", tmp_path / "run"], tmp_path)
    # a minibatch of 8 rows; 40 tokens hold 3 padded rows of 7 prompt + 4 response tokens: micro-batches of 2
    assert "; padded micro-batches of 2 rows instead (--micro-batch-size 2)" in out
    config = json.load(open(tmp_path / "run/config.json"))
    assert (config["micro_batch_tokens"], config["micro_batch_size"]) == (0, 2)
    check_outputs(tmp_path / "run", 2)
    # a resume may name the micro-batch flags again (they differ from the config's fallback); one of them alone too
    for again in (args, ["--micro-batch-tokens", "40"]):
        out = run_script([*again, "--resume", pt.checkpoints(tmp_path / "run")[0]], tmp_path)
        assert "padded micro-batches of 2 rows instead" in out and "after iteration 1/2" in out


# ---------------------------------------------------------------------------------------------------------------
# prompts and rewards


def test_bad_reward_function_output_is_a_clear_error(tmp_path):
    (tmp_path / "bad_rewards.py").write_text("def short(prompts, completions):\n    return [1.0]\n")
    proc = run_main([*TINY, "--reward", "bad_rewards:short", "--output-dir", str(tmp_path / "run"), "--demo-cache",
                     str(tmp_path / "cache")], tmp_path)
    assert proc.returncode != 0 and "returned 1 scores for 16 completions" in proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# environments (--env): multi-turn rollouts


class ScriptedEnv:
    """Every step answers `observation` (as `role`) and rewards turn k with 10 k + the turn's token count."""

    def __init__(self, observation="<=", role="user"):
        self.observation, self.role, self.turn = observation, role, 0

    def reset(self, prompt, seed=None):
        return prompt, {}

    def step(self, action, completion_ids, ended):
        self.turn += 1
        return self.observation, 10.0 * self.turn + len(completion_ids), False, False, {"role": self.role}


def episodes(tokenizer, sampler, texts, env=ScriptedEnv, T=40, max_turns=3, seed=0, chat=False, resize=None,
             **overrides):
    cfg = pt.Config(response_length=T, max_turns=max_turns, temperature=1.0, chat_template=chat, **overrides)
    args = pt.sampling_args(cfg, tokenizer.pad_token_id, [tokenizer.eos_token_id], vocab=len(tokenizer))
    return cfg, pt.run_episodes(sampler, [env() for _ in texts], texts, list(range(len(texts))), tokenizer, cfg,
                                None, resize, **args, generator=torch.Generator().manual_seed(seed))


def check_conversation(batch, tokenizer, observation_ids, T):
    """Every row: policy runs and observation runs; each observation is exactly observation_ids (never sampled: no
    log-prob), each turn but the last ends with EOS, and each turn's reward sits on its last token."""
    turns = 0
    for r in range(len(batch.response)):
        used = int(batch.context_mask[r].sum())
        assert batch.context_mask[r, :used].all() and not batch.context_mask[r, used:].any() and used <= T
        policy, column, rewards = batch.response_mask[r].bool(), 0, []
        assert (policy <= batch.context_mask[r].bool()).all() and policy[0]
        while column < used:
            start = column
            while column < used and policy[column] == policy[start]:
                column += 1
            ids = batch.response[r, start:column].tolist()
            if policy[start]:
                n = len(ids) - (ids[-1] == tokenizer.eos_token_id)
                rewards.append(10.0 * (len(rewards) + 1) + n)
                assert batch.token_rewards[r, column - 1] == rewards[-1]
                assert column == used or ids[-1] == tokenizer.eos_token_id  # a turn continues only after EOS
            else:
                assert ids == observation_ids and (batch.behav_logprobs[r, start:column] == 0).all()
        assert batch.token_rewards[r].sum() == sum(rewards) and batch.episodes["rewards"][r] == rewards
        turns += len(rewards)
    return turns


def test_multi_turn_episodes_mask_observations_and_score_like_the_whole_conversation():
    tokenizer = pt.build_demo_tokenizer(hints=True)
    policy = tiny_llama(len(tokenizer), seed=3, max_position_embeddings=256)
    texts = ["1+2=", "37+45=", "9+90=", "5+5=", "12+4=", "0+0="]  # ragged: left padding in every turn
    cfg, batch = episodes(tokenizer, policy, texts)
    turns = check_conversation(batch, tokenizer, tokenizer("<=", add_special_tokens=False)["input_ids"], 40)
    assert turns > len(texts) and (batch.context_mask > batch.response_mask).any()  # some rows had a second turn
    # each turn's re-prefill gives the log-probs of scoring the whole conversation, observations as context
    logprobs, _ = pt.rollout_logprobs(policy, batch, cfg)
    torch.testing.assert_close(logprobs, batch.behav_logprobs, rtol=0, atol=1e-10)
    assert (logprobs[batch.response_mask == 0] == 0).all()  # no log-prob (loss, KL, entropy) on an observation
    # the fast decoder (static cache, P + 2T columns): rows that finished leave their places to copies of an active
    # one (its batch size is fixed), so its random draws differ from the plain loop's after that; a conversation
    # valid all the same
    decoder = pt.fast_decoder(policy, len(texts), 7 + 2 * 120, pt.PlainDecoder)
    assert type(decoder) is pt.StaticDecoder
    fast = episodes(tokenizer, decoder, texts)[1]
    check_conversation(fast, tokenizer, tokenizer("<=", add_special_tokens=False)["input_ids"], 40)
    torch.testing.assert_close(pt.rollout_logprobs(policy, fast, cfg)[0], fast.behav_logprobs, rtol=0, atol=1e-10)
    short = pt.fast_decoder(policy, len(texts), 20, pt.PlainDecoder)  # turns that do not fit: one line, not silence
    with pytest.raises(RuntimeError, match="PPO_TOKENS_STRICT=1: --env: first observations of up to 7 tokens and a "
                                           "budget of 40 need 87 columns, more than the static cache's 20"):
        episodes(tokenizer, short, texts)
    grown = []  # or, given a way to, a static cache sized from what the turns prefill (train: static_decoder)
    resized = episodes(tokenizer, short, texts, resize=lambda columns: grown.append(columns) or decoder)[1]
    assert grown == [87] and torch.equal(resized.response, fast.response)  # (decoder: 247 columns, the same draws)
    # two turns that every row reaches (120 tokens: EOS comes first): both decoders sample the same conversation
    plain, fast = (episodes(tokenizer, sampler, texts, T=120, max_turns=2)[1] for sampler in (policy, decoder))
    assert int(plain.context_mask.sum()) > int(plain.response_mask.sum()) > 0
    for name in ("response", "response_mask", "context_mask", "token_rewards", "policy_version", "ended"):
        assert torch.equal(getattr(fast, name), getattr(plain, name)), name
    torch.testing.assert_close(fast.behav_logprobs, plain.behav_logprobs, rtol=0, atol=1e-12)
    # packed scoring reads the same holes
    torch.testing.assert_close(pt.rollout_logprobs(policy, batch, dataclasses.replace(cfg, micro_batch_tokens=999))[0],
                               logprobs, rtol=0, atol=1e-10)
    # top-k: an observation's kept ids are itself; the rescoring renormalises over the sampler's sets
    cfg_k, topk = episodes(tokenizer, policy, texts, top_k=5)
    check_conversation(topk, tokenizer, tokenizer("<=", add_special_tokens=False)["input_ids"], 40)
    torch.testing.assert_close(pt.rollout_logprobs(policy, topk, cfg_k)[0], topk.behav_logprobs, rtol=0, atol=1e-10)
    # an empty observation: the next turn follows the stop token directly
    cfg, quiet = episodes(tokenizer, policy, texts, env=functools.partial(ScriptedEnv, ""))
    assert torch.equal(quiet.context_mask, quiet.response_mask) and sum(map(len, quiet.episodes["rewards"])) > 6
    # each row's own budget: it stops there (not ended), and the other rows sample what they would have
    ids, mask = pt.left_pad(pt.format_prompts(tokenizer, texts, False, 64), tokenizer.pad_token_id, "cpu")
    args = pt.sampling_args(cfg, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    full, cut = (pt.generate(policy, ids, mask, **{**args, "max_new_tokens": 30}, budgets=budgets,
                             generator=torch.Generator().manual_seed(5)) for budgets in (None, torch.tensor([2] * 6)))
    assert (cut.response_mask.sum(1) <= 2).all() and torch.equal(cut.response[:, :2], full.response[:, :2])
    assert torch.equal(cut.ended, full.ended & (full.response_mask.sum(1) <= 2))


def chat_tokenizer():  # characters plus role and end-of-turn tokens, with a chat template that knows a tool role
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<|end|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|eot|>"]
    vocab = {t: i for i, t in enumerate([*specials, *"0123456789+=<>?!\n abc"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|end|>",
                                  additional_special_tokens=specials[2:])
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return tok


def test_a_tool_observation_goes_through_the_chat_template_as_context():
    tokenizer = chat_tokenizer()
    policy = tiny_llama(len(tokenizer), seed=4)
    tool = functools.partial(ScriptedEnv, "42", "tool")  # a Python function tool's answer, as a tool message
    cfg, batch = episodes(tokenizer, policy, ["1+2", "3+4", "50+6"], env=tool, chat=True)
    # after the policy's <|end|>: the rest of the template's turn end, the tool message, the assistant header
    expected = tokenizer("\n<|tool|>42<|end|>\n<|assistant|>", add_special_tokens=False)["input_ids"]
    assert check_conversation(batch, tokenizer, expected, 40) > 3
    first = tokenizer.apply_chat_template([{"role": "user", "content": "1+2"}], add_generation_prompt=True,
                                          tokenize=False)
    first = tokenizer(first, add_special_tokens=False)["input_ids"]
    assert batch.prompt_ids[0, -len(first):].tolist() == first  # the first observation: the chat's user turn
    torch.testing.assert_close(pt.rollout_logprobs(policy, batch, cfg)[0], batch.behav_logprobs, rtol=0, atol=1e-10)
    # a turn that ended with another stop id (Qwen's <|endoftext|>, Llama 3's <|eom_id|>): the template's end of turn
    eot = tokenizer.convert_tokens_to_ids("<|eot|>")
    assert pt.observation_ids(tokenizer, "42", "tool", True, eot) == [
        tokenizer.eos_token_id, *expected]  # <|end|>, then as after <|end|>
    readme = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()  # the README's tool, as written there
    namespace = {}  # (the example as written: its own imports)
    exec(readme[readme.index("import math\n\nclass SqrtTool"):].split("```")[0], namespace)
    tool = namespace["SqrtTool"]()
    assert tool.reset("sqrt(x) to 3 decimals? x = 17") == ("sqrt(x) to 3 decimals? x = 17", {})
    assert pt.env_step(tool, "sqrt 2", 0.0, {}) == ("1.414214", 0.0, False, "tool", None)
    assert pt.env_step(tool, "4.123", 0.0, {"ended": True})[1:3] == (1.0, True)


ENV_RUN = ["--env", "demo", "--batch-size", "16", "--minibatches", "2", "--steps", "2", "--demo-warmup-steps", "0",
           "--eval-size", "40", "--eval-every", "1", "--sample-every", "1", "--device", "cpu"]


def test_the_multi_turn_demo_runs_and_logs_success_by_turn(tmp_path):
    answers = {}  # the guessing game: a+b or a hidden neighbour 10 away, of the seed; the hint says which side
    for seed in range(30):
        env, control = pt.AdditionRetry(), pt.AdditionRetry(hint=False)
        env.reset("12+30=", seed), control.reset("12+30=", seed)
        answers[seed] = env.answer
        assert env.step(str(env.answer), ended=True)[1:3] == (1.0, True)
        assert env.step(str(env.answer), ended=False)[1] == 0.0  # (without EOS)
        assert env.step("42")[0] == ("" if env.answer == 42 else "12+30=<" if 42 < env.answer else "12+30=>")
        assert control.step("7")[0] == "12+30==" and control.answer == env.answer
    assert set(answers.values()) == {32, 42, 52}
    # a neighbour keeps the number of digits and is never negative (else the other side); below 10 it may gain one
    assert [pt.neighbour(n, d) for n, d in ((95, 10), (12, -10), (5, -10), (5, 10), (50, -10))] == [85, 22, 15, 15, 40]
    game, one_turn = (pt.addition_task(pt.make_config(**flags)) for flags in ({"env": "demo"}, {}))
    sums = [sum(map(int, p.rstrip("=").split("+"))) for p in game.prompts + game.evaluate.keywords["texts"]]
    assert max(sums) == 89 and len(game.evaluate.keywords["texts"]) == 1000  # (the tens digit: the answer's first)
    assert len(one_turn.prompts) == 9000
    assert max(sum(map(int, p.rstrip("=").split("+"))) for p in one_turn.prompts) == 198
    out = run_script([*ENV_RUN, "--output-dir", tmp_path / "run", "--demo-cache", tmp_path / "cache"], tmp_path)
    before, *records = read_metrics(tmp_path / "run")
    assert "--response-length 16" in out and "turn1" in out and "second_try" in out
    for r in (before, *records):
        assert 0 <= r["eval_turn1"] <= r["eval_accuracy"] <= 1 and 0 <= r["eval_second_try"] <= 1
    assert all(1 < r["turns_mean"] <= 2 and r["env_errors"] == 0 for r in records)  # (an untrained model: misses)
    assert len(records) == 2 and all(math.isfinite(r["pg_loss"]) for r in records)


def test_multi_turn_tokens_carry_the_version_they_were_sampled_with():
    tokenizer = pt.build_demo_tokenizer(hints=True)
    policy, texts = tiny_llama(len(tokenizer), seed=3, max_position_embeddings=256), ["1+2=", "37+45="]
    cfg = pt.Config(response_length=40, max_turns=3, temperature=1.0, chat_template=False)
    args = pt.sampling_args(cfg, tokenizer.pad_token_id, [tokenizer.eos_token_id], len(tokenizer))
    batch = pt.run_episodes(policy, [ScriptedEnv() for _ in texts], texts, [0, 1], tokenizer, cfg, None,
                            **{**args, "policy_version": 7}, generator=torch.Generator().manual_seed(0))
    assert (batch.policy_version == 7).all() and max(map(len, batch.episodes["rewards"])) > 1  # (second turns too)


def test_multi_turn_staleness_one_tags_every_turns_tokens(tmp_path):
    run_script([*ENV_RUN, "--max-staleness", "1", "--steps", "3",
                "--output-dir", tmp_path / "run", "--demo-cache", tmp_path / "cache"], tmp_path)
    records = read_metrics(tmp_path / "run")[1:]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["staleness_max"] <= 1 for r in records)
    assert records[-1]["staleness_mean"] > 0 and all(math.isfinite(r["pg_loss"]) for r in records)


@slow
def test_multi_turn_resume_after_kill_and_under_torchrun(tmp_path):
    from safetensors.torch import load_file
    (tmp_path / "killer_env.py").write_text(
        "import os, signal, sys\nsys.path.insert(0, %r)\nimport ppo_tokens\ncalls = 0\n"
        "class Killer(ppo_tokens.AdditionRetry):  # kill -9 at step call $KILL_AT, from the pool's thread\n"
        "    def step(self, action, ended=True):\n        global calls\n        calls += 1\n"
        "        if calls == int(os.environ.get('KILL_AT', '0')):\n            os.kill(os.getpid(), signal.SIGKILL)\n"
        "        return super().step(action, ended)\n" % HERE)
    args = ["--env", "killer_env:Killer", *ENV_RUN[2:], "--steps", "4", "--save-every", "1", "--eval-size", "1",
            "--eval-every", "100", "--sample-every", "0", "--demo-cache", str(tmp_path / "cache")]
    run_script([*args, "--output-dir", tmp_path / "full"], tmp_path)
    killed = run_raw([*args, "--output-dir", str(tmp_path / "part")], tmp_path, KILL_AT="40")  # in iteration 2 or 3
    assert killed.returncode == -9 and 1 <= len(pt.checkpoints(tmp_path / "part")) <= 2
    assert "resumed from" in run_script(["--resume", str(tmp_path / "part")], tmp_path)
    full = load_file(tmp_path / "full/policy/model.safetensors")
    part = load_file(tmp_path / "part/policy/model.safetensors")
    assert all(torch.equal(full[k], part[k]) for k in full)
    assert [r.get("turns_mean") for r in read_metrics(tmp_path / "full")] == \
        [r.get("turns_mean") for r in read_metrics(tmp_path / "part")]
    # two ranks, each with its own environments: identical weights, and a resume that ends at them
    base = [digest_script(tmp_path), "--env", "demo", *ENV_RUN[2:], "--steps", "2", "--save-every", "1",
            "--eval-size", "4", "--sample-every", "0"]
    full = digests(torchrun([*base, "--output-dir", str(tmp_path / "ddp")], tmp_path).stdout)
    resumed = torchrun([base[0], "--resume", str(pt.checkpoints(tmp_path / "ddp")[0])], tmp_path).stdout
    assert full[0] == full[1] and digests(resumed) == full


def test_every_environment_is_closed_after_its_episodes_even_after_an_error():
    """A sandbox, a subprocess: run_episodes closes each environment, whether its episodes end, a reset() fails, the
    run stops mid-turn (Producer.close at --max-staleness > 0) or another environment's close() raises."""
    tokenizer = pt.build_demo_tokenizer(hints=True)
    policy, texts, closed = tiny_llama(len(tokenizer), seed=3, max_position_embeddings=256), ["1+2=", "3+4="], []

    class Sandbox(ScriptedEnv):
        def __init__(self, fails=""):  # where it raises: "reset", "close" or nowhere
            super().__init__()
            self.fails = fails

        def reset(self, prompt, seed=None):
            if self.fails == "reset":
                raise RuntimeError("no sandbox")
            return super().reset(prompt, seed)

        def close(self):
            closed.append(self)
            if self.fails == "close":
                raise RuntimeError("cannot close")
    cfg = pt.Config(response_length=20, max_turns=2, temperature=1.0, chat_template=False)
    args = pt.sampling_args(cfg, tokenizer.pad_token_id, [tokenizer.eos_token_id], vocab=len(tokenizer))
    stopping = threading.Event()
    stopping.set()
    for fails, stop, error in (("", None, None), ("reset", None, SystemExit), ("close", None, RuntimeError),
                               ("", stopping, InterruptedError)):
        envs, closed[:] = [Sandbox(fails), Sandbox()], []
        with contextlib.nullcontext() if error is None else pytest.raises(error):
            pt.run_episodes(policy, envs, texts, [0, 1], tokenizer, cfg, None, **args, stop=stop,
                            generator=torch.Generator().manual_seed(0))
        assert sorted(closed, key=id) == sorted(envs, key=id), fails or stop  # (each, once)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")  # (the skipped updates')
def test_bad_environments_get_one_line_and_lose_nothing(tmp_path, capsys):
    (tmp_path / "envs.py").write_text(
        "import sys\nsys.path.insert(0, %r)\nimport ppo_tokens\n"
        "class Flaky(ppo_tokens.AdditionRetry):  # every third episode's tool fails\n"
        "    made = 0\n"
        "    def __init__(self):\n        super().__init__()\n        Flaky.made += 1\n        self.n = Flaky.made\n"
        "    def step(self, action, ended=True):\n"
        "        if self.n %% 3 == 0:\n            raise ConnectionError('tool down')\n"
        "        return super().step(action, ended)\n"
        "class Down(Flaky):\n    def step(self, action, ended=True):\n        raise ConnectionError('tool down')\n"
        "class NoText(Flaky):\n    def step(self, action, ended=True):\n        return 7, 0.0, False, False, {}\n"
        "class NaN(Flaky):\n    def step(self, action, ended=True):\n        return '', float('nan'), True, False, {}\n"
        "class Seeds(Flaky):  # records each episode's prompt and seed\n"
        "    def reset(self, prompt, seed=None):\n"
        "        open('seeds.txt', 'a').write(f'{prompt} {seed}\\n')\n        return super().reset(prompt, seed)\n"
        "class NoReset(Flaky):  # a bare str, not (str, info): its first character would have been the prompt\n"
        "    def reset(self, prompt, seed=None):\n        return prompt\n"
        "def broken():\n    raise RuntimeError('no sandbox')\n" % HERE)
    run = [a for a in ENV_RUN if a != "demo"][1:] + ["--demo-cache", tmp_path / "cache"]
    out = run_script(["--env", "envs:Flaky", *run, "--output-dir", tmp_path / "flaky"], tmp_path)
    assert "episodes of batch 0 ended on an error; the first: ConnectionError: tool down" in out
    assert all(r["env_errors"] >= 5 for r in read_metrics(tmp_path / "flaky")[1:])  # (16 rows: 5 or 6 failed)
    proc = run_main(["--env", "envs:Down", *run, "--output-dir", tmp_path / "down"], tmp_path)
    assert proc.returncode == 1 and "the environment failed in 16 of 16 episodes of batch 0" in proc.stderr
    assert "the last good checkpoint is none" in proc.stderr
    proc = run_main(["--env", "envs:NoText", *run, "--output-dir", tmp_path / "notext"], tmp_path)
    assert proc.returncode == 1 and "(TypeError: step() returned a int observation, not a str)" in proc.stderr
    run_script(["--env", "envs:Seeds", *run, "--steps", "1", "--advantage", "grpo", "--samples-per-prompt", "4",
                "--output-dir", tmp_path / "seeds"], tmp_path)
    rows = [line.split() for line in (tmp_path / "seeds.txt").read_text().splitlines()][40:56]  # (after 40 held-out)
    assert sorted(collections.Counter(map(tuple, rows)).values()) == [4] * 4  # a group's 4 rows: one prompt, one seed
    assert len({seed for _, seed in rows}) == 4
    out = run_script(["--env", "envs:NaN", *run, "--output-dir", tmp_path / "nan"], tmp_path)  # the non-finite guard
    assert out.count("update skipped: non-finite token_rewards in rows [0, 1, 2") == 2
    for env, message in (("nowhere:make", "--env 'nowhere:make': cannot load it (ModuleNotFoundError"),
                         ("envs:broken", "--env 'envs:broken': its factory raised RuntimeError: no sandbox"),
                         ("envs:NoReset", "--env: reset() raised TypeError: it must return (the first observation, "
                                          "a str; info)")):
        proc = run_main(["--env", env, *run, "--output-dir", tmp_path / "x"], tmp_path)
        assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    status, message = exit_of(["--env", "demo", "--reward", "m:f"], capsys)
    assert status == 2 and "--env gives the rewards (each step's): drop --reward / --reward-model" in message


# ---------------------------------------------------------------------------------------------------------------
# the overlapped loop's machinery: packed weight sync


def test_packed_weight_sync_makes_sampler_and_trainer_weights_identical():
    policy = tiny_llama(16, seed=1, dtype=torch.float32, tie_word_embeddings=True)
    sampler, flat = pt.sampler_copy(policy, torch.bfloat16)  # made in one buffer, each tied weight once
    assert flat.numel() == sum(p.numel() for p in policy.parameters())
    assert sampler.lm_head.weight.dtype == torch.bfloat16
    assert sampler.lm_head.weight.data_ptr() == sampler.model.embed_tokens.weight.data_ptr()  # (still tied)
    assert all(torch.equal(p.to(torch.bfloat16), q) for p, q in zip(policy.parameters(), sampler.parameters()))
    sampler, flat = pt.sampler_copy(policy, torch.float32)
    sync = pt.WeightSync(policy, flat)
    lo, n = sync.sampler_flat.data_ptr(), sync.sampler_flat.numel() * sync.sampler_flat.element_size()
    assert all(lo <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= lo + n
               for p in sampler.parameters())  # views of one buffer
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p))  # the trainer moves on
    assert sync.pull() == 0 and not torch.equal(sampler.lm_head.weight, policy.lm_head.weight)  # nothing published
    held = sampler.lm_head.weight.clone()
    sync.publish(1)
    assert torch.equal(sampler.lm_head.weight, held)  # a publish stages; the sampler's weights change at its pull
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(2)  # after publishing: the sampler must get version 1, not this
    assert sync.pull() == 1
    for (name, p), q in zip(policy.named_parameters(), sampler.parameters()):
        assert torch.equal(p / 2, q), name


# ---------------------------------------------------------------------------------------------------------------
# logging, checkpoints, resume, the non-finite guard


def saved_keys(checkpoint):  # the names in a checkpoint's DCP metadata
    from torch.distributed.checkpoint import FileSystemReader
    return FileSystemReader(checkpoint).read_metadata().state_dict_metadata.keys()


def write_killer_module(path):  # a reward that kills its own process (kill -9) at call $KILL_AT, else count_ones
    (path / "killer.py").write_text("import os, signal\ncalls = 0\ndef score(prompts, completions):\n"
                                    "    global calls\n    calls += 1\n"
                                    "    if calls == int(os.environ.get('KILL_AT', '0')):\n"
                                    "        os.kill(os.getpid(), signal.SIGKILL)\n"
                                    "    return [c.count('1') / 4 for c in completions]\n")


def run_raw(args, cwd, **env):  # a process of its own, for what only a process shows (kill -9)
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **env})


@slow
@pytest.mark.parametrize("more", [[], ["--lora-rank", "4"]], ids=["full", "lora"])  # LoRA: adapters, value head
def test_resume_after_kill_ends_with_the_same_weights_as_an_uninterrupted_run(tmp_path, more):
    from safetensors.torch import load_file
    write_killer_module(tmp_path)
    args = [a if a != "count_ones:score" else "killer:score" for a in LOOP] + ["--save-every", "1", *more]
    run_script([*args, "--output-dir", str(tmp_path / "full")], tmp_path)
    killed = run_raw([*args, "--output-dir", str(tmp_path / "part")], tmp_path, KILL_AT="3")  # in iteration 3
    assert killed.returncode == -9 and [os.path.basename(c) for c in pt.checkpoints(tmp_path / "part")] == \
        ["step-00000001", "step-00000002"]
    out = run_script(["--resume", f"{tmp_path / 'part'}/"], tmp_path)  # the flags come from the checkpoint
    assert "resumed from" in out and "step-00000002 after iteration 2/4" in out
    full = load_file(tmp_path / "full/policy/model.safetensors")
    part = load_file(tmp_path / "part/policy/model.safetensors")
    assert full.keys() == part.keys() and all(torch.equal(full[k], part[k]) for k in full)
    a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "part")
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]  # each iteration logged once
    for key in ("pg_loss", "vf_loss", "reward_mean", "lr", "kl"):
        assert [r.get(key) for r in a] == [r.get(key) for r in b], key
    assert [os.path.basename(c) for c in pt.checkpoints(tmp_path / "part")] == ["step-00000003", "step-00000004"]
    refused = run_main([*args, "--output-dir", str(tmp_path / "part")], tmp_path)  # a finished run, without --resume
    assert refused.returncode == 1 and "already holds a run" in refused.stderr and "--resume" in refused.stderr


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_before_the_first_optimizer_step_keeps_adam_unstepped_and_the_loop_state_per_rank(tmp_path):
    import torch.distributed.checkpoint as dcp
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    state = pt.checkpoint_state(model, None, (optimizer, None), [], pt.Dist(), torch.Generator().get_state(),
                                torch.Generator(), step=0, first_accuracy=0.5, time_s=1.0)  # (older: no prompts_drawn)
    assert not optimizer.state  # get_state_dict's made-up state (AdamW's step 1) is taken back
    assert state["rank0"]["first_accuracy"] == 0.5 and "first_accuracy" not in state  # only rank 0 evaluates
    dcp.save(state, checkpoint_id=tmp_path / "step-00000000")
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    loop = pt.load_checkpoint(str(tmp_path / "step-00000000"), fresh, None, (fresh_optimizer, None), [])
    assert not fresh_optimizer.state and torch.equal(fresh.weight, model.weight)
    assert (loop["step"], loop["first_accuracy"], loop["time_s"]) == (0, 0.5, 1.0) and "prompts_drawn" not in loop
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # after a step the checkpoint holds the real state
    pt.checkpoint_state(model, None, (optimizer, None), [], pt.Dist(), torch.Generator().get_state(),
                        torch.Generator(), step=1, first_accuracy=0.5, time_s=1.0, prompts_drawn=0)
    assert int(optimizer.state[model.weight]["step"]) == 1


@slow
def test_a_kill_while_writing_a_checkpoint_leaves_the_previous_one_whole(tmp_path):
    write_reward_module(tmp_path)
    (tmp_path / "kill_in_second_checkpoint.py").write_text(  # kill -9 after its files, before DCP's .metadata
        f"import os, signal, sys\nsys.path.insert(0, {HERE!r})\nimport ppo_tokens\n"
        "from torch.distributed.checkpoint import FileSystemWriter\nfinish, calls = FileSystemWriter.finish, []\n"
        "def killing_finish(self, **kwargs):\n    calls.append(1)\n    if len(calls) == 2:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n    return finish(self, **kwargs)\n"
        "FileSystemWriter.finish = killing_finish\nppo_tokens.main(sys.argv[1:])\n")
    args = [*LOOP, "--save-every", "1", "--output-dir", str(tmp_path / "run")]
    killed = subprocess.run([sys.executable, "kill_in_second_checkpoint.py", *args], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -9
    assert [os.path.basename(c) for c in pt.checkpoints(tmp_path / "run")] == ["step-00000001"]
    assert os.listdir(tmp_path / "run/checkpoints/step-00000002")  # the half-written one, without .metadata: not used
    assert load_into_fresh_models(pt.checkpoints(tmp_path / "run")[0])["step"] == 1
    out = run_script([*args, "--resume"], tmp_path)
    assert "step-00000001 after iteration 1/4" in out and "dropped 1 metrics records" in out
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2, 3, 4]
    # step 3: resuming from it sets the newer step 4 aside, never deletes it
    older = pt.checkpoints(tmp_path / "run")[0]
    out = run_script(["--resume", str(older)], tmp_path)
    assert "set aside" in out
    assert any(p.name.startswith(".abandoned-step-00000004-") for p in (tmp_path / "run/checkpoints").iterdir())
    assert [os.path.basename(c) for c in pt.checkpoints(tmp_path / "run")] == ["step-00000003", "step-00000004"]


def test_sigterm_after_a_save_every_checkpoint_does_not_rewrite_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "term.py").write_text("import os, signal\ncalls = 0\ndef score(prompts, completions):\n"
                                      "    global calls\n    calls += 1\n    if calls == 2:\n"
                                      "        os.kill(os.getpid(), signal.SIGTERM)\n"
                                      "    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    args = [a if a != "count_ones:score" else "term:score" for a in LOOP]
    cfg = pt.parse_config([*args, "--save-every", "1", "--output-dir", str(tmp_path / "run")])
    os.makedirs(cfg.output_dir)
    history = pt.train(cfg, pt.setup(cfg), cfg.output_dir)
    out = capsys.readouterr().out
    assert len(history) == 2 and "stopped by SIGTERM after iteration 2/4" in out
    assert [l.split("/")[-1] for l in out.splitlines() if l.startswith("checkpoint: ")] == ["step-00000001",
                                                                                           "step-00000002"]  # once each
    with pytest.raises(SystemExit):  # a resume continues its run where it is, not in another directory
        pt.parse_config(["--resume", str(pt.checkpoints(tmp_path / "run")[-1]), "--output-dir", str(tmp_path / "b")])
    assert f"--resume continues its run in {tmp_path / 'run'}, not --output-dir" in capsys.readouterr().err
    sys.modules["term"].calls = 0  # a signal in the last iteration: the run ends as it would have
    cfg = pt.parse_config([*args, "--steps", "2", "--save-every", "2", "--output-dir", str(tmp_path / "last")])
    os.makedirs(cfg.output_dir)
    run = pt.setup(cfg)
    assert len(pt.train(cfg, run, cfg.output_dir)) == 2
    out = capsys.readouterr().out
    assert "stopped by" not in out and "done: 2 iterations" in out
    written = {f: os.stat(f).st_mtime_ns for f in (tmp_path / "last/policy").iterdir()}
    save = type(run.tokenizer).save_pretrained  # a crash in the final save, after the weights: policy/ stays whole

    def crash(self, path, **kwargs):
        if "checkpoints" not in str(path):
            raise OSError("disk full")
        return save(self, path, **kwargs)
    monkeypatch.setattr(type(run.tokenizer), "save_pretrained", crash)
    cfg = pt.parse_config(["--resume", str(pt.checkpoints(tmp_path / "last")[-1])])
    with pytest.raises(OSError, match="disk full"):
        pt.train(cfg, pt.setup(cfg), cfg.output_dir)  # (an empty loop: straight to the final save)
    assert {f: os.stat(f).st_mtime_ns for f in (tmp_path / "last/policy").iterdir()} == written
    monkeypatch.undo()  # a crash between the renames left the old policy/ aside: the next save goes on
    (tmp_path / "last/policy.old").mkdir()
    (tmp_path / "last/policy.old/model.safetensors").write_text("stale")
    pt.train(cfg, pt.setup(cfg), cfg.output_dir)
    assert sorted(p.name for p in (tmp_path / "last").iterdir() if p.name.startswith("policy")) == ["policy"]


def test_a_signal_after_a_skipped_update_keeps_the_count_of_skips_in_its_checkpoint(tmp_path, monkeypatch, capsys):
    (tmp_path / "nan_term.py").write_text("import os, signal\ncalls = 0\ndef score(prompts, completions):\n"
                                          "    global calls\n    calls += 1\n    if calls == 2:\n"
                                          "        os.kill(os.getpid(), signal.SIGTERM)\n"
                                          "        return [float('nan')] * len(completions)\n"
                                          "    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    cfg = pt.parse_config([*[a if a != "count_ones:score" else "nan_term:score" for a in LOOP], "--output-dir", "run"])
    os.makedirs(cfg.output_dir)
    pt.train(cfg, pt.setup(cfg), cfg.output_dir)
    (checkpoint,) = pt.checkpoints(tmp_path / "run")  # (iteration 2's update skipped, then the signal's checkpoint)
    assert load_into_fresh_models(checkpoint)["bad_steps"] == 1  # a resume goes on counting toward --max-bad-steps
    sys.modules["nan_term"].calls = 1  # the resumed run's first batch: NaN again (and a signal)
    cfg = pt.parse_config(["--resume", checkpoint])
    capsys.readouterr()
    pt.train(cfg, pt.setup(cfg), cfg.output_dir)
    assert " | 2/3 in a row" in capsys.readouterr().out  # (not 1/3)


def test_non_finite_rewards_skip_updates_then_stop_with_the_last_good_checkpoint_intact(tmp_path):
    (tmp_path / "nan_later.py").write_text("calls = 0\ndef score(prompts, completions):\n    global calls\n"
                                           "    calls += 1\n"
                                           "    bad = calls == 2 or calls > 3  # (a good update between: a new count)\n"
                                           "    return [float('nan') if bad else 0.5] * len(completions)\n")
    args = [a if a != "count_ones:score" else "nan_later:score" for a in LOOP]
    proc = run_main([*args, "--steps", "6", "--save-every", "1", "--max-bad-steps", "2", "--output-dir",
                     str(tmp_path / "run")], tmp_path)
    assert proc.returncode == 1 and "stopping: 2 consecutive updates skipped for non-finite values" in proc.stderr
    assert "the last good checkpoint is" in proc.stderr and "step-00000003" in proc.stderr.splitlines()[-1]
    assert "update skipped: non-finite raw_scores in rows [0, 1, 2, 3, 4, 5, 6, 7] ... of 16" in proc.stdout
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if "skipped_update" in r] == [2, 4, 5]
    assert [os.path.basename(c) for c in pt.checkpoints(tmp_path / "run")] == ["step-00000001", "step-00000003"]
    load_into_fresh_models(pt.checkpoints(tmp_path / "run")[-1])


# ---------------------------------------------------------------------------------------------------------------
# torchrun: data-parallel PPO over processes (gloo on CPU)


def torchrun(args, cwd, nproc=2, timeout=300, check=True):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    assert not check or proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def digest_script(cwd):
    """A script that runs ppo_tokens.py's main() and, at the end of the run, prints every rank's sha256 of the weights
    it last published (gathered by rank 0): ranks that train data-parallel must agree to the bit."""
    (cwd / "train_and_digest.py").write_text(
        f"import hashlib, sys, torch\nsys.path.insert(0, {HERE!r})\nimport ppo_tokens\n"
        "finish_training = ppo_tokens.finish_training\n"
        "def digest_then_finish(t):\n"
        "    digest = hashlib.sha256(t.sync.staging.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]\n"
        "    digests = [None] * t.ctx.world\n    torch.distributed.all_gather_object(digests, digest)\n"
        "    print('actor weights (sha256) on each rank:', *digests, flush=True)\n"
        "    if t.sync.trainer_flat is None and t.sync.merged is None:  # FSDP2: a publish gathers every parameter's\n"
        "        # shards in one collective\n"
        "        from torch.distributed.tensor.debug import CommDebugMode\n"
        "        with CommDebugMode() as comm:\n            t.sync.publish(t.sync.version)\n"
        "        full = torch.cat([p.full_tensor().reshape(-1) for p in t.sync.policy.parameters()])\n"
        "        print('publish:', comm.get_total_counts(), 'collective, the trainer\\'s weights:',\n"
        "              torch.equal(full.to(t.sync.staging), t.sync.staging), flush=True)\n"
        "    print('trained weights on', next(t.actor.parameters()).device.type, flush=True)\n"
        "    from torch.distributed.tensor import DTensor  # (resharded after each forward: 1 / world on each rank)\n"
        "    shards = all(isinstance(p, DTensor) for p in t.run.reference.parameters())\n"
        "    print('reference held as shards:', shards, flush=True)\n"
        "    finish_training(t)\n"
        "ppo_tokens.finish_training = digest_then_finish\nppo_tokens.main(sys.argv[1:])\n")
    return str(cwd / "train_and_digest.py")


def patched_script(cwd, name: str, patch: str, after: str = "") -> str:
    """A script that runs `patch` after importing ppo_tokens, then the script named by its first argument (as
    __main__), then `after`: a CUDA-only path's logic, run on gloo."""
    (cwd / name).write_text(f"import runpy, sys\nsys.path.insert(0, {HERE!r})\nimport ppo_tokens\n{patch}"
                            f"runpy.run_path(sys.argv.pop(1), run_name='__main__')\n{after}")
    return str(cwd / name)


def digests(out):  # the per-rank checksums of the actor weights digest_script prints at the end
    (line,) = [l for l in out.splitlines() if l.startswith("actor weights (sha256")]
    return line.split(": ")[1].split()


LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def first_iteration(world: int, rank: int, loss_agg="token-mean"):
    """One scoring pass and one PPO update (SGD, 1 minibatch of 2-row micro-batches) on this rank's share of a fixed
    batch of 8 rollouts, with DDP under torchrun. Returns (all-rank advantages, reduced stats, actor weights).
    The sequence-mean --loss-agg modes get completions of unequal lengths."""
    tokenizer, cfg = pt.build_demo_tokenizer(), pt.Config(batch_size=8, minibatches=1, ppo_epochs=1, response_length=4,
                                                          micro_batch_size=2, loss_agg=loss_agg)
    policy = tiny_llama(len(tokenizer), seed=4, dtype=torch.float32)
    reference = tiny_llama(len(tokenizer), seed=5, dtype=torch.float32).requires_grad_(False)
    texts = [f"{a}+{b}=" for a, b in [(1, 2), (37, 45), (9, 90), (5, 5), (12, 3), (0, 0), (99, 99), (50, 7)]]
    batch = demo_rollout(tokenizer, policy, texts)
    if loss_agg != "token-mean":
        shorten(batch)
    batch = batch.rows(torch.arange(rank * 8 // world, (rank + 1) * 8 // world))
    actor, critic = (pt.wrap_for_training(m, cfg) for m in (pt.Actor(policy, 1.0), pt.build_critic(policy)))
    score_frozen(batch, reference, lambda b: (b.response % 3 == 0).float().sum(-1), cfg)
    pt.score_trainer(batch, actor, critic, cfg, torch.arange(8 // world))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (actor, critic)]
    stats = pt.reduce_record(pt.ppo_update(actor, critic, *opts, batch, cfg, [torch.arange(8 // world)]), world)
    advantages = [torch.zeros_like(batch.advantages) for _ in range(world)]
    if world > 1:
        torch.distributed.all_gather(advantages, batch.advantages)
    return torch.cat(advantages if world > 1 else [batch.advantages]), stats, [p.detach() for p in policy.parameters()]


def frozen_scores(rank: int, group=None):
    """This rank's half of a fixed batch of 8: the reference's log-probs of every row and a reward model's scores,
    replicated, or (group) sharded over group's ranks as --fsdp shards them (shards_frozen) and scored as the run
    scores them. Rank 0's groups are all flat (their rows leave the loss), rank 1's are not: a sharded reference must
    still be forwarded as often on both ranks, since each forward all-gathers its weights."""
    tokenizer = pt.build_demo_tokenizer()
    cfg = pt.Config(advantage="grpo", samples_per_prompt=2, batch_size=8, minibatches=1, response_length=4)
    reference = pt.Actor(tiny_llama(len(tokenizer), seed=5, dtype=torch.float32).requires_grad_(False), 1.0)
    reward_model = pt.build_critic(tiny_llama(len(tokenizer), seed=6, dtype=torch.float32)).requires_grad_(False)
    torch.nn.init.normal_(reward_model.head.weight, generator=torch.Generator().manual_seed(7))
    texts = [f"{a}+{b}=" for a, b in [(1, 2), (1, 2), (9, 90), (9, 90), (12, 3), (12, 3), (99, 99), (99, 99)]]
    batch = demo_rollout(tokenizer, tiny_llama(len(tokenizer), seed=4, dtype=torch.float32), texts)
    batch = batch.rows(torch.arange(4 * rank, 4 * rank + 4))
    batch.scores = torch.tensor([0.0, 0.0, 0.0, 0.0] if rank == 0 else [0.0, 1.0, 0.0, 1.0])
    if group is None:
        logprobs = pt.rollout_logprobs(reference, batch, cfg)[0]
    else:
        for model in (reference, reward_model):
            pt.fsdp_shard(model, group, reshard_after_forward=True)
        assert all(type(p).__name__ == "DTensor" for m in (reference, reward_model) for p in m.parameters())
        pt.score_frozen(batch, reference, cfg, group)
        logprobs = batch.ref_logprobs
    return logprobs, pt.reward_model_scores(reward_model, tokenizer, tokenizer, batch, False, micro_batch_size=3)


def unequal_shares(rank: int):  # (x, mask): a rank's share of a logged statistic, 3 elements on rank 0, 12 on rank 1
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(rank), dtype=torch.float64) + 2.0 * rank
    mask = torch.zeros(5, 3, dtype=torch.bool)
    mask[:1 + 3 * rank] = True
    return x, mask


@slow
def test_whitening_the_first_update_and_sharded_frozen_models_do_not_depend_on_the_world_size(tmp_path):
    torchrun([os.path.abspath(__file__), str(tmp_path / "world2.pt")], tmp_path)
    # the logged statistics over the rows in the loss: the mean over both ranks' elements, not of the ranks' means
    (x0, m0), (x1, m1) = unequal_shares(0), unequal_shares(1)
    expected = float(pt.masked_mean(torch.cat([x0, x1]), torch.cat([m0, m1])))
    assert math.isclose(torch.load(tmp_path / "world2.pt")["global_means"][0], expected, rel_tol=1e-12)
    assert abs(expected - (pt.masked_mean(x0, m0) + pt.masked_mean(x1, m1)) / 2) > 0.5  # (which would differ)
    # --fsdp's sharded reference and reward model score as the replicated ones, on both ranks
    replicated, sharded = torch.load(tmp_path / "world2.pt")["frozen"]
    for (logprobs, scores), (want_logprobs, want_scores) in zip(sharded, replicated):
        assert torch.equal(logprobs, want_logprobs) and torch.equal(scores, want_scores)
    advantages, stats, weights = first_iteration(1, 0)
    two = torch.load(tmp_path / "world2.pt")["token-mean"]
    torch.testing.assert_close(two["advantages"], advantages, rtol=1e-5, atol=1e-6)  # whitened over both ranks
    assert abs(float(two["advantages"][:4][two["advantages"][:4] != 0].mean())) > 1e-3  # not whitened per rank
    for key in ("pg_loss", "vf_loss", "entropy", "clipfrac", "approx_kl", "grad_norm", "critic_grad_norm"):
        got, want = two["stats"][key], stats[key]
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6), (key, got, want)
    for a, b in zip(two["weights"], weights):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for agg in LOSS_AGGS[1:]:  # the same step from one rank as from two, micro-batches of 2 rows on each
        _, stats, weights = first_iteration(1, 0, agg)
        two = torch.load(tmp_path / "world2.pt")[agg]
        assert math.isclose(two["stats"]["pg_loss"], stats["pg_loss"], rel_tol=1e-4, abs_tol=1e-6), agg
        for a, b in zip(two["weights"], weights):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@slow
def test_dynamic_sampling_chooses_the_same_groups_at_one_rank_and_two_and_with_the_overlapped_loop(tmp_path):
    """Which groups a batch holds is chosen over every rank's groups in one order, so a run at one rank and at two
    (gloo, the sampler thread at --max-staleness 1) train on the same prompts. The reward decides by prompt: two in
    three prompts' groups are flat, the others have signal."""
    (tmp_path / "by_prompt.py").write_text(
        "def score(prompts, completions):\n"
        "    seen = {}\n    out = []\n"
        "    for p in prompts:  # a group's rows lie side by side: its k-th row scores k, or all 0\n"
        "        seen[p] = seen.get(p, -1) + 1\n"
        "        a, b = p.rstrip('=').split('+')\n"
        "        out.append(float(seen[p]) if (int(a) + int(b)) % 3 == 0 else 0.0)\n"
        "    return out\n")
    (tmp_path / "record.py").write_text(  # each rank's batch prompts, as the reference scores them
        f"import json, os, sys\nsys.path.insert(0, {HERE!r})\nimport ppo_tokens\n"
        "scored = ppo_tokens.score_frozen\n"
        "def recording(batch, *rest):\n"
        "    with open(f\"batches{os.environ.get('RANK', '0')}.jsonl\", 'a') as f:\n"
        "        f.write(json.dumps(batch.prompts) + '\\n')\n"
        "    return scored(batch, *rest)\n"
        "ppo_tokens.score_frozen = recording\nppo_tokens.main(sys.argv[1:])\n")
    args = ["record.py", "--reward", "by_prompt:score", "--advantage", "grpo", "--samples-per-prompt", "4",
            "--batch-size", "16", "--minibatches", "2", "--steps", "3", "--response-length", "4", "--dynamic-sampling",
            "3", "--demo-warmup-steps", "0", "--eval-size", "40", "--sample-every", "0", "--no-compile-sampler",
            "--device", "cpu"]
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    for d in (one, two):
        for name in ("by_prompt.py", "record.py"):
            shutil.copy(tmp_path / name, d / name)
    subprocess.run([sys.executable, *args, "--output-dir", "run"], cwd=one, check=True, capture_output=True)
    torchrun([*args, "--max-staleness", "1", "--output-dir", "run"], two)
    batches = [json.loads(line) for line in (one / "batches0.jsonl").read_text().splitlines()]
    halves = [[json.loads(line) for line in (two / f"batches{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert [a + b for a, b in zip(*halves)] == batches and len(batches) == 3
    for prompts in batches:  # every group with signal: its prompt's sum divides by 3
        assert len(prompts) == 16 and all(sum(map(int, p.rstrip("=").split("+"))) % 3 == 0 for p in prompts)
    records = read_metrics(one / "run")
    assert all(r["sampling_rounds"] >= 2 and 0 < r["filtered_frac"] < 1 for r in records if r["step"] > 0)


@slow
def test_torchrun_an_environment_that_fails_on_one_rank_stops_every_rank_with_its_line(tmp_path):
    """reset() fails on rank 1 only: the ranks decide together (the producer's gloo group), so each rank exits with
    the same one line, rather than rank 0 waiting in a collective until the launcher kills it."""
    (tmp_path / "flaky_node.py").write_text(
        "import os\n"
        "class FailsOnRank1:\n"
        "    def reset(self, prompt, seed=None):\n"
        "        if os.environ.get('RANK') == '1':\n"
        "            raise RuntimeError('no sandbox on this node')\n"
        "        return prompt, {}\n"
        "    def step(self, action, ended=True):\n"
        "        return '', 1.0, True, False, {}\n")
    proc = torchrun([SCRIPT, "--env", "flaky_node:FailsOnRank1", "--batch-size", "8", "--minibatches", "2", "--steps",
                     "2", "--demo-warmup-steps", "0", "--eval-size", "40", "--sample-every", "0", "--device", "cpu",
                     "--output-dir", "run"], tmp_path, timeout=120, check=False)
    assert proc.returncode != 0
    line = "--env: reset() raised RuntimeError: no sandbox on this node; the last good checkpoint is none"
    assert (proc.stdout + proc.stderr).count(line) == 2, proc.stdout[-2000:] + proc.stderr[-3000:]


@slow
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # (peft's from_pretrained)
def test_torchrun_critic_free_ddp_and_fsdp2_train_and_resume(tmp_path):
    write_reward_module(tmp_path)
    base = [digest_script(tmp_path), *LOOP, "--steps", "3", "--save-every", "2", "--samples-per-prompt", "4"]
    # LoRA under DDP and under FSDP2 (adapters synchronised or sharded, the merged weights published and resumed alike
    # on both ranks; FSDP2's: gathered from the shards, and equal to DDP's up to the order of the reductions). Whole
    # minibatches: the dropped flat groups skip their forwards, so the ranks' row counts differ
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    for name, more in (("ddp", []), ("fsdp", ["--fsdp"])):
        out_dir = tmp_path / name
        out = torchrun([*base, "--advantage", "rloo", "--lora-rank", "4", "--micro-batch-size", "0", *more,
                        "--output-dir", str(out_dir)], tmp_path).stdout
        full, saved = digests(out), saved_keys(pt.checkpoints(out_dir)[-1])
        assert full[0] == full[1] and not any(k.startswith("critic") for k in saved)
        assert sum(r.get("zero_std_groups", 0) for r in read_metrics(out_dir)) > 0  # (flat groups were dropped)
        actor = [k for k in saved if k.startswith("actor.")]  # LoRA: a checkpoint holds the adapters (and their Adam
        assert actor and all("lora_" in k for k in actor)  # states: actor_optimizer), not the frozen base
        if name == "fsdp":  # (DDP's and one process's resume: test_resume_after_kill_...[lora], ..._two_ranks_...)
            resumed = torchrun([base[0], "--resume", str(pt.checkpoints(out_dir)[0])], tmp_path).stdout
            assert "step-00000002 after iteration 2/3" in resumed and digests(resumed) == full, name
            assert "reference sharded over 2 ranks (FSDP2)" in out  # (the base's tree, adapters off)
            # CUDA's --max-staleness > 0 keeps the frozen models whole (shards_frozen): the reference's tree still
            # holds the base's own tensors while FSDP2 shards the policy's; its log-probs (the KL) are the same
            whole = patched_script(tmp_path, "whole.py", "ppo_tokens.shards_frozen = lambda cfg, device: False\n")
            out = torchrun([whole, *base, "--advantage", "rloo", "--lora-rank", "4", "--micro-batch-size", "0", *more,
                            "--output-dir", str(tmp_path / "whole")], tmp_path).stdout
            assert "reference and reward model replicated" in out and digests(out) == full
            ddp, fsdp = (AutoModelForCausalLM.from_pretrained(tmp_path / d / "policy") for d in ("ddp", "fsdp"))
            adapted = PeftModel.from_pretrained(pt.build_demo_policy(pt.build_demo_tokenizer(), seed=1),
                                                out_dir / "policy_adapter").merge_and_unload()
            for (key, a), b, c in zip(ddp.state_dict().items(), fsdp.state_dict().values(),
                                      adapted.state_dict().values(), strict=True):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=key)
                torch.testing.assert_close(c, b, rtol=0, atol=1e-6, msg=key)  # policy_adapter/ on the base: policy/


@slow
def test_torchrun_two_ranks_ddp_and_fsdp2_train_resume_and_stay_identical(tmp_path):
    from transformers import AutoModelForCausalLM
    write_reward_module(tmp_path)
    args = [digest_script(tmp_path), *LOOP, "--steps", "3", "--save-every", "2", "--micro-batch-size", "0",
            "--micro-batch-tokens", "40", "--gradient-checkpointing"]  # packed, checkpointed, under DDP and FSDP2
    out = torchrun([*args, "--output-dir", str(tmp_path / "ddp")], tmp_path).stdout
    first, second = digests(out)
    assert first == second and out.count("it    3/3") == 1  # DDP keeps the replicas identical; one rank prints
    assert [r["step"] for r in read_metrics(tmp_path / "ddp")] == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.rglob("metrics.jsonl")) == ["metrics.jsonl"]  # written once, by rank 0
    check_outputs(tmp_path / "ddp", 3)
    out = torchrun([*args, "--fsdp", "--output-dir", str(tmp_path / "fsdp")], tmp_path).stdout
    fsdp = digests(out)
    assert "publish: 1 collective, the trainer's weights: True" in out
    assert "reference sharded over 2 ranks (FSDP2)" in out  # (its log-probs: the KL in the reward of DDP's run)
    assert "reference held as shards: True" in out
    # FSDP2 holds one copy of each weight (its digest is of a gather, equal on every rank by construction): its
    # update must be DDP's, up to the order of the gradient reductions
    ddp_policy, fsdp_policy = (AutoModelForCausalLM.from_pretrained(tmp_path / d / "policy") for d in ("ddp", "fsdp"))
    for (name, a), b in zip(ddp_policy.state_dict().items(), fsdp_policy.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)
    earlier = AutoModelForCausalLM.from_pretrained(tmp_path / "ddp/checkpoints/step-00000002/policy")
    assert any(not torch.equal(a, b) for a, b in zip(ddp_policy.state_dict().values(), earlier.state_dict().values()))
    resumed = torchrun([args[0], "--resume", str(pt.checkpoints(tmp_path / "fsdp")[0])], tmp_path).stdout
    assert "step-00000002 after iteration 2/3" in resumed and digests(resumed) == fsdp  # the same final weights
    offload = patched_script(tmp_path, "offload_on_a_cpu.py", (  # --fsdp --offload's logic (CUDA only)
        "import torch.distributed.fsdp as fsdp\n"
        "made, policy, setup, shard = [], fsdp.CPUOffloadPolicy, ppo_tokens.setup, ppo_tokens.fsdp_shard\n"
        "fsdp.CPUOffloadPolicy = lambda: policy(pin_memory=False)  # (a CPU has no pinned memory)\n"
        "def past_the_refusal(cfg, ctx):  # setup refuses --offload on a CPU: the flag comes back after it\n"
        "    cfg.offload = False\n    run = setup(cfg, ctx)\n    cfg.offload = True\n    return run\n"
        "def recorded(model, group=None, offload=False, **options):\n"
        "    made.append(offload)\n    return shard(model, group, offload, **options)\n"
        "ppo_tokens.setup, ppo_tokens.fsdp_shard = past_the_refusal, recorded\n"),
        after="print('offloaded FSDP2 models:', sum(made), 'of', len(made), flush=True)\n")
    out = torchrun([offload, *args, "--fsdp", "--offload", "--output-dir",
                    str(tmp_path / "offload")], tmp_path).stdout  # (its GPU twin: test_cuda_torchrun_nccl)
    assert digests(out) == fsdp and "offloaded FSDP2 models: 3 of 3" in out  # (the policy, critic and reference)
    (tmp_path / "rank_one_fails.py").write_text("import os\ndef score(prompts, completions):\n"
                                               "    if os.environ['RANK'] == '1':\n"
                                               "        raise RuntimeError('reward server unreachable from rank 1')\n"
                                               "    return [0.0] * len(completions)\n")
    failed = torchrun([*[a if a != "count_ones:score" else "rank_one_fails:score" for a in args], "--output-dir",
                       str(tmp_path / "fails")], tmp_path, timeout=120, check=False)
    assert failed.returncode != 0 and "reward server unreachable from rank 1" in failed.stdout + failed.stderr
    (tmp_path / "rank_one_cannot_pack.py").write_text(  # rank 1's packed attention is wrong: both ranks go padded
        f"import os, sys\nsys.path.insert(0, {HERE!r})\nimport ppo_tokens\nos.environ.pop('PPO_TOKENS_STRICT')\n"
        "if os.environ['RANK'] == '1':\n    k = ppo_tokens.kernels\n    shift = k._right_padded\n"
        "    k._right_padded = lambda x, layout: shift(x, layout).roll(1, dims=2)\nppo_tokens.main()\n")
    out = torchrun([tmp_path / "rank_one_cannot_pack.py", *args[1:], "--steps", "1", "--output-dir",
                    str(tmp_path / "padded")], tmp_path, timeout=120).stdout
    assert "--micro-batch-tokens off: another rank's model cannot run packed; padded micro-batches of " in out
    check_outputs(tmp_path / "padded", 1)


def test_batch_sizes_are_checked_against_the_world_size(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit):
        pt.parse_config(["--batch-size", "24", "--minibatches", "4"])
    message = "--batch-size 24 must be divisible by --minibatches 4 x 4 ranks (torchrun's WORLD_SIZE)"
    assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pt.parse_config(["--batch-size", "32", "--minibatches", "2", "--micro-batch-size", "3"])
    assert "the minibatch size per rank (--batch-size 32 / --minibatches 2 x 4 ranks" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one device per rank, cuda:LOCAL_RANK (checked before CUDA's presence)
        pt.parse_config(["--batch-size", "32", "--device", "cuda:1"])
    assert "--device cuda:1: under torchrun each rank uses cuda:LOCAL_RANK" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# benchmarks


def test_bench_rollout_runs_and_ends_with_the_ratio_line(tmp_path):  # the entry point; speeds are not asserted
    out = run_script(["--bench-rollout", "--batch-size", "8", "--response-length", "3", "--minibatches", "2",
                      "--demo-hidden", "32", "--demo-layers", "1", "--device", "cpu"], tmp_path)
    assert all(row in out for row in ("HF generate", "plain loop", "StaticDecoder"))
    assert re.fullmatch(r"sampler vs generate: \d+\.\d\dx", out.strip().splitlines()[-1])
    out = run_script(["--bench-rollout", "--batch-size", "8", "--response-length", "3", "--minibatches", "2",
                      "--demo-hidden", "32", "--demo-layers", "1", "--device", "cpu", "--advantage", "rloo",
                      "--samples-per-prompt", "2"], tmp_path)  # groups: each group's prompt prefilled once
    assert "shared prefill" in out
    assert out.strip().splitlines()[-1].startswith("sampler vs generate: ")


# ---------------------------------------------------------------------------------------------------------------
# the command line: config errors name the flags, --help lists every field, bad input is refused in one line


def test_config_errors_name_the_flags(capsys):
    cases = [(["--batch-size", "10", "--minibatches", "4"], "--batch-size 10 must be divisible by --minibatches 4"),
             (["--batch-size", "16", "--minibatches", "2", "--micro-batch-size", "3"], "--micro-batch-size 3"),
             (["--temperature", "-0.5"], "--temperature must be > 0"),
             (["--max-staleness", "-1"], "--max-staleness must be >= 0"),
             (["--kl-estimator", "k4"], "--kl-estimator must be k1, k2 or k3"),
             (["--kl-in", "both"], "--kl-in must be reward or loss"),
             (["--advantage", "ppo"], "--advantage must be gae, reinforce++, grpo or rloo"),
             (["--temperature", "0"], "--temperature must be > 0 (got 0.0): PPO's ratio needs a sampling"),
             (["--advantage", "grpo", "--samples-per-prompt", "1"],
              "--advantage grpo compares the completions of a prompt: --samples-per-prompt"),
             (["--batch-size", "12", "--minibatches", "2", "--samples-per-prompt", "8"],
              "--batch-size 12 must be divisible by --samples-per-prompt 8"),
             (["--scale-rewards", "std"], "--scale-rewards must be group, batch or none"),
             (["--loss-agg", "seq-mean"], "--loss-agg must be token-mean, seq-mean-token-mean or"),
             (["--clip-range-high", "-0.1"], "--clip-range-high must be >= 0"),
             (["--micro-batch-size", "-1"], "--micro-batch-size must be >= 0"),
             (["--clip-range", "0"], "--clip-range must be > 0"), (["--lr", "0"], "--lr must be > 0 (got 0.0)"),
             (["--gamma", "1.5"], "--gamma must be in 0..1"), (["--kl-coef", "-0.1"], "--kl-coef must be >= 0"),
             (["--max-prompt-length", "0"], "--max-prompt-length must be >= 1"),
             (["--max-grad-norm", "-1"], "--max-grad-norm must be >= 0"),
             (["--policy-loss", "dapo"], "--policy-loss must be ppo, gspo or cispo"),
             (["--advantage", "grpo", "--samples-per-prompt", "2", "--kl-estimator", "k1"],
              "--kl-in loss needs --kl-estimator k2 or k3")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "--device cuda: CUDA is not available here; use --device cpu"))
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            pt.parse_config(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_resume_refuses_a_flag_newer_than_the_checkpoint_unless_at_its_default(tmp_path, capsys):
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / ".metadata").write_bytes(b"")
    old = {k: v for k, v in vars(pt.Config()).items() if k not in ("advantage", "samples_per_prompt", "kl_in", "task")}
    (checkpoint / "config.json").write_text(json.dumps(old))  # written before those flags existed
    cfg = pt.parse_config(["--resume", str(checkpoint)])
    assert cfg.advantage == "gae" and cfg.kl_in == "reward" and cfg.resume == str(checkpoint)
    with pytest.raises(SystemExit):
        pt.parse_config(["--resume", str(checkpoint), "--advantage", "grpo", "--samples-per-prompt", "4"])
    assert "--advantage grpo differs from the checkpoint's gae" in capsys.readouterr().err
    # a --model run's config from before --task: resumed as a --model run (no demo task), the demo model's with
    # --prompts as then (no warm-up)
    (checkpoint / "config.json").write_text(json.dumps({**old, "model": "m", "prompts": str(checkpoint / ".metadata"),
                                                        "reward": "r:f", "lr": 1e-6}))
    cfg = pt.parse_config(["--resume", str(checkpoint)])
    assert cfg.task == "" and cfg.model == "m" and cfg.lr == 1e-6
    (checkpoint / "config.json").write_text(json.dumps({**old, "prompts": str(checkpoint / "config.json")}))
    cfg = pt.parse_config(["--resume", str(checkpoint)])
    assert cfg.task == "demo" and cfg.demo_warmup_steps == 0


def test_presets_change_defaults_before_the_flags_and_never_replace_a_flag_given(capsys, monkeypatch):
    """Config's declared defaults are the single-turn demo's and run as they are; a preset (--model, the critic-free
    or the multi-turn demo) changes some of them before the flags given, and never a flag given, also one that equals
    Config's default (which a sentinel rule would have replaced). The log says what each preset gave."""
    assert pt.parse_config([]) == pt.Config()  # what the fields say is what runs
    grpo = pt.parse_config(["--advantage", "grpo"])
    assert (grpo.samples_per_prompt, grpo.batch_size, grpo.steps, grpo.ppo_epochs, grpo.lr) == (8, 512, 800, 1, 3e-4)
    assert (grpo.kl_in, grpo.kl_estimator, grpo.temperature, grpo.drop_flat_groups) == ("loss", "k3", 0.7, True)
    out = capsys.readouterr().out
    assert "preset critic-free demo: --steps 800, --ppo-epochs 1, --lr 0.0003\n" in out
    assert "preset grouped demo: --samples-per-prompt 8, --batch-size 512\n" in out
    reinforce = pt.make_config(advantage="reinforce++")  # critic-free, but no groups: one completion a prompt
    assert (reinforce.samples_per_prompt, reinforce.batch_size, reinforce.steps) == (1, 256, 800)
    given = pt.parse_config(["--advantage", "rloo", "--samples-per-prompt", "4", "--steps", "300", "--batch-size", "16",
                             "--ppo-epochs", "2", "--lr", "5e-4", "--no-compile-sampler"])  # Config's defaults, given
    assert (given.steps, given.batch_size, given.ppo_epochs, given.lr) == (300, 16, 2, 5e-4)
    assert not given.compile_sampler
    assert "preset" not in capsys.readouterr().out  # nothing taken from it
    env = pt.parse_config(["--env", "demo"])  # the multi-turn demo: clip-higher and a stronger KL keep it exploring
    assert (env.steps, env.kl_coef, env.clip_range_high, env.demo_warmup_steps, env.temperature) == \
        (100, 0.1, 0.28, 1300, 1.0)
    assert env.response_length == 16 and pt.make_config(env="demo", max_turns=3).response_length == 28
    assert pt.make_config(env="demo", advantage="grpo").steps == 800  # the critic-free demo's (its one pass)
    assert pt.parse_config(["--env", "demo", "--kl-coef", "0.02"]).kl_coef == 0.02  # equal to Config's: kept
    assert pt.parse_config(["--env", "demo", "--kl-coef", "0"]).kl_coef == 0.0
    real = pt.make_config(model="m", device="cpu")  # a demo's learning rates would wreck a real model
    assert (real.lr, real.critic_lr, real.steps, real.batch_size, real.response_length, real.ppo_epochs) == \
        (1e-6, 1e-5, 1000, 64, 256, 1)
    assert real.temperature == 1.0 and real.bf16 and real.dtype == "bfloat16" and not real.compile_sampler
    assert pt.make_config(model="m", bf16=False, device="cpu").dtype == "float32"  # auto: bf16 on CUDA or --bf16
    assert pt.make_config(model="m", temperature=0.7, lr=5e-4).lr == 5e-4  # the demo's values, given: kept
    grouped = pt.make_config(model="m", advantage="grpo", samples_per_prompt=8)
    assert (grouped.batch_size, grouped.kl_in, grouped.kl_estimator) == (64, "loss", "k3")  # --model's, not the demo's
    # the 'auto' words: an estimator declares where its KL goes, a policy loss its paper's aggregation
    assert pt.make_config(policy_loss="gspo").loss_agg == "seq-mean-token-mean"  # as the GSPO paper and verl
    assert pt.make_config(policy_loss="gspo", loss_agg="token-mean").loss_agg == "token-mean"
    assert pt.make_config(policy_loss="cispo").loss_agg == pt.Config().loss_agg == "token-mean"
    assert pt.make_config(advantage="grpo", kl_in="reward").kl_estimator == "k1"
    monkeypatch.setattr(pt, "native_bf16", lambda device: False)  # --bf16 where it would be emulated: refused
    with pytest.raises(SystemExit, match="--bf16: cpu has no bf16 matmuls .*; pass --no-bf16"):
        pt.setup(pt.Config(bf16=True, device="cpu"))


def test_help_lists_every_config_field():
    out = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, check=True).stdout
    for f in pt.dataclasses.fields(pt.Config):
        assert "--" + f.name.replace("_", "-") in out
    assert "PPO ratio clip epsilon" in out
    assert "(default: 300; --model: 1000; multi-turn demo: 100; critic-free demo: 800)" in " ".join(out.split())
    assert "multi-turn demo: --steps 100, --response-length 16" in out  # the presets, whole


def exit_of(argv, capsys):  # (exit status, message) of the real entry point, in-process
    with pytest.raises(SystemExit) as e:
        pt.main(argv)
    err = capsys.readouterr().err
    return (e.value.code, err) if isinstance(e.value.code, int) else (1, str(e.value.code))  # as the interpreter


def test_bad_input_is_refused_with_one_clear_line(tmp_path, capsys, monkeypatch, tokenizer):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad_rewards_2.py").write_text("def boom(p, c):\n    raise ValueError('no scorer')\n"
                                               "def words(p, c):\n    return ['high'] * len(c)\n")
    write_reward_module(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "1+1"}\n{"prompt": "2+2"}\n{"text": "3+3"}\n')
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": "1" * 70}) + "\n")
    no_eos = pt.build_demo_tokenizer()
    no_eos.eos_token = None
    tiny_llama(len(tokenizer), dtype=torch.float32).save_pretrained(tmp_path / "no_eos")
    no_eos.save_pretrained(tmp_path / "no_eos")
    from transformers import MambaConfig, MambaForCausalLM  # a recurrent state the batched sampler cannot drive
    MambaForCausalLM(MambaConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, state_size=4,
                                 expand=1)).save_pretrained(tmp_path / "mamba")
    tokenizer.save_pretrained(tmp_path / "mamba")
    tiny_llama(len(tokenizer), dtype=torch.float32, tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
    tokenizer.save_pretrained(tmp_path / "tied")
    os.makedirs(tmp_path / "old_run/checkpoints/step-00000003")
    (tmp_path / "old_run/checkpoints/step-00000003/.metadata").write_bytes(b"")  # DCP's: a whole checkpoint
    base = [*LOOP, "--steps", "1"]

    def with_prompts(name):
        return [*base, "--prompts", str(tmp_path / name)]

    (tmp_path / "good.jsonl").write_text(json.dumps({"prompt": "1+1"}) + "\n")
    (tmp_path / "tasks.py").write_text("import ppo_tokens\ndef raises(cfg):\n    raise KeyError('split')\n"
                                       "def wrong(cfg):\n    return {}\ndef bare(cfg):\n    return ppo_tokens.Task()\n")
    capsys.readouterr()
    cases = [([*with_prompts("good.jsonl"), "--model", str(tmp_path / "nowhere")], 1,
              f"--model {tmp_path / 'nowhere'}: cannot load"),
             ([*base, "--reward", "", "--reward-model", "nowhere"], 2, "--reward-model nowhere: no such directory"),
             ([*base, "--prompts", "nowhere.jsonl"], 2, "--prompts nowhere.jsonl: no such file"),
             (with_prompts("binary.jsonl"), 1, "cannot read it as UTF-8 text"),
             (with_prompts("empty.jsonl"), 1, "the file holds no prompts"),
             (with_prompts("broken.jsonl"), 1, "line 3 is not a JSON object with a 'prompt' field"),
             ([*with_prompts("long.jsonl"), "--max-prompt-length", "100"], 1,
              "the longest prompt (71 tokens) plus --response-length 6 exceeds the model's context of 64 tokens"),
             ([*base, "--reward", "bad_rewards_2:boom"], 1, "the reward function raised ValueError: no scorer"),
             ([*base, "--reward", "bad_rewards_2:words"], 1, "the reward function must return a list of numbers"),
             ([*base, "--reward", "bad_rewards_2:missing"], 1, "--reward 'bad_rewards_2:missing': cannot load it"),
             ([*with_prompts("good.jsonl"), "--model", str(tmp_path / "no_eos")], 1, "has no EOS token"),
             ([*with_prompts("good.jsonl"), "--model", str(tmp_path / "mamba")], 1, "mamba is not supported"),
             ([*with_prompts("good.jsonl"), "--model", str(tmp_path / "tied"), "--lora-rank", "4", "--lora-targets",
               "q_proj,lm_head"], 1, "--lora-targets: lm_head is this model's input embedding too (tied weights)"),
             ([*with_prompts("good.jsonl"), "--model", str(tmp_path / "tied"), "--lora-rank", "4", "--lora-targets",
               "embed_tokens"], 1, "--lora-targets: model.embed_tokens is this model's output head too (tied weights)"),
             ([*base, "--batch-size", "15"], 2, "--batch-size 15 must be divisible by --minibatches 2"),
             ([*base, "--temperature", "-1"], 2, "--temperature must be > 0"),
             ([*base, "--output-dir", str(tmp_path / "old_run")], 1,
              "already holds a run (metrics.jsonl, checkpoints); continue it with --resume"),
             ([*base, "--resume", "--output-dir", ""], 2, "--resume needs --output-dir DIR"),
             ([*base, "--resume", str(tmp_path / "nowhere")], 2, "--resume: no whole checkpoint in"),
             ([*base, "--task", "tasks:raises"], 1, "--task 'tasks:raises': its factory raised KeyError: 'split'"),
             ([*base, "--task", "tasks:wrong"], 1, "the factory returned a dict, not a ppo_tokens.Task"),
             ([*base, "--task", "tasks:bare"], 1, "no model: pass --model (an HF causal LM), or a --task that builds"),
             ([*base, "--lora-rank", "4", "--lora-targets", "q_proj, nosuch_proj"], 1,
              "no linear layer of the model is named nosuch_proj"),
             ([*base, "--lora-rank", "4", "--lora-alpha", "0"], 2, "--lora-alpha must be > 0 (got 0.0)"),
             ([*base, "--offload"], 1, "--offload moves what waits on a GPU to the host; this run is on cpu")]
    if not torch.cuda.is_available():
        cases.append(([*base, "--device", "cuda"], 2, "--device cuda: CUDA is not available here; use --device cpu"))
    for i, (argv, status, message) in enumerate(cases):
        if "--output-dir" not in argv:
            argv = [*argv, "--output-dir", str(tmp_path / f"run{i}")]
        code, err = exit_of(argv, capsys)
        assert (code, message in err) == (status, True), (argv, code, err)
        assert len(err.strip().splitlines()) == 1 or status == 2, err  # one line (argparse adds a usage line)
    with open(tmp_path / "old_run/checkpoints/step-00000003/config.json", "w") as f:
        json.dump(pt.dataclasses.asdict(pt.parse_config(base)), f)
    code, err = exit_of(["--resume", str(tmp_path / "old_run"), "--lr", "0.1"], capsys)
    assert code == 2 and "--lr 0.1 differs from the checkpoint's 0.003; drop the flag or start a new run" in err
    with pytest.raises(SystemExit, match=r"1 of 2 prompts are no tokens to the tokenizer \(the first is prompt 2, ''"):
        pt.format_prompts(lambda texts: {"input_ids": [[5] if t else [] for t in texts]}, ["12", ""], False, 30)
    ids = pt.format_prompts(tokenizer, ["1" * 70, "12"], False, 30)
    assert [len(x) for x in ids] == [30, 3]
    assert "1 of 2 prompts are longer than --max-prompt-length 30" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# kernels.py: Triton (under TRITON_INTERPRET=1 on CPU) and the torch path against the float64 torch path

# Under the interpreter, the where() branches that a kernel discards are still computed by numpy (0 * -inf, ...).
pytestmark = [pytest.mark.filterwarnings(f"ignore:{m}:RuntimeWarning")
              for m in ("invalid value encountered", "divide by zero encountered", "overflow encountered")]

V, BLOCK = 1000, 256  # a vocab that is not a multiple of the (test-sized) block


def nan_empty(*args, empty=torch.empty, **kwargs):  # the kernel tests' torch.empty (empty: the real one)
    new = empty(*args, **kwargs)
    return new.fill_(float("nan")) if new.is_floating_point() else new


@pytest.fixture
def kernel_env(monkeypatch):
    torch.manual_seed(0)  # a fixed seed: every run checks the same inputs
    # Small blocks so several vocab blocks and a ragged tail are exercised; outputs and gradients that start as NaN,
    # so every row that the kernels should write but do not fails the comparison.
    monkeypatch.setattr(kernels, "BLOCK_V", BLOCK)
    monkeypatch.setattr(torch, "empty", nan_empty)
    torch.set_default_device(KERNEL_DEVICE)  # compiled kernels on a CUDA machine, the interpreter on CPU
    yield
    torch.set_default_device(None)  # no default-device mode left behind (a torch.compile guard sees it)


def close(actual, expected, rtol, atol, what):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def make_inputs(n, vocab, dtype, scale=3.0, offset=0.0, masked=True):
    """logits (n, vocab), tokens, and a mask with ~1/4 rows off (their logits NaN/inf garbage)."""
    logits = (torch.randn(n, vocab) * scale + offset).to(dtype)
    tokens = torch.randint(0, vocab, (n,))
    mask = torch.rand(n) > 0.25 if masked else None
    if masked:
        logits[~mask] = float("nan")
        logits[~mask, :3] = float("inf")
        tokens[~mask] = 10**9  # garbage ids too: never read
    return logits, tokens, mask


def grads_of(outs, inputs, upstream):
    """d(sum_i upstream_i * out_i) / d(inputs): a random upstream gradient on all outputs at once."""
    loss = sum((o.double() * g).sum() for o, g in zip(outs, upstream))
    return torch.autograd.grad(loss, inputs)


def reference(logits, tokens, temperature, **kw):
    """Float64 torch path on the SAME (possibly bf16-rounded) values, with its gradient w.r.t. the logits."""
    x = logits.detach().double().requires_grad_()
    return x, kernels.token_logprobs(x, tokens, temperature, backend="torch", **kw)


@pytest.mark.usefixtures("kernel_env")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inplace", [False, True])
def test_triton_matches_reference(dtype, inplace):
    logits, tokens, mask = make_inputs(48, V, dtype)
    x_ref, want = reference(logits, tokens, 0.7, mask=mask)
    base = logits.clone().requires_grad_()
    x = base * 1  # a non-leaf: the in-place backward overwrites its storage, which is then the returned gradient
    got = kernels.token_logprobs(x, tokens, 0.7, mask=mask, backend="triton", inplace_backward=inplace)
    for g, w, name in zip(got, want, ["logp", "entropy"]):
        assert g.dtype == torch.float32 and g.shape == tokens.shape
        close(g, w, rtol=2e-5, atol=2e-5, what=name)  # the kernel accumulates in fp32 from the exact inputs: ~1e-6
        assert (g[~mask] == 0).all(), f"{name} at masked rows must be exactly 0"
    upstream = [torch.randn(tokens.shape, dtype=torch.float64) for _ in range(2)]
    (d_x,) = grads_of(got, [x], upstream)
    (d_ref,) = grads_of(want, [x_ref], upstream)
    if inplace:
        assert d_x.data_ptr() == x.data_ptr(), "in-place backward must write into the logits' storage"
    # fp32 grads: p = exp(z - lse) inherits the fp32 rounding of lse times the upstream gradient (seen ~2e-5
    # relative), and at the sampled token a - p * a cancels when p ~ 1 (a few eps x |a|, |a| up to ~15: seen 3e-6
    # absolute), so rtol 1e-4, atol 1e-5; bf16 grads are stored in bf16 (rel. rounding 2^-9), so rtol 1e-2
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
    close(d_x, d_ref, what="d logits", **tol)
    assert (d_x[~mask] == 0).all(), "masked rows must get exactly 0 gradient"


@pytest.mark.usefixtures("kernel_env")
@pytest.mark.parametrize("inplace", [False, True])
def test_torch_fallback_fp32_matches_reference(inplace, monkeypatch):
    monkeypatch.setattr(kernels, "_TORCH_CHUNK_ELEMS", 7 * V)  # several row chunks, the last one ragged
    logits, tokens, mask = make_inputs(40, V, torch.float32)
    x_ref, want = reference(logits, tokens, 0.7, mask=mask)
    x = logits.clone().requires_grad_() * 1
    got = kernels.token_logprobs(x, tokens, 0.7, mask=mask, backend="torch", inplace_backward=inplace)
    for g, w, name in zip(got, want, ["logp", "entropy"]):
        close(g, w, rtol=2e-5, atol=2e-5, what=name)  # fp32 math on exact inputs
        assert (g[~mask] == 0).all()
    upstream = [torch.randn(tokens.shape, dtype=torch.float64) for _ in range(2)]
    (d_x,) = grads_of(got, [x], upstream)
    close(d_x, grads_of(want, [x_ref], upstream)[0], rtol=1e-4, atol=1e-5, what="d logits")  # as above
    assert (d_x[~mask] == 0).all(), "masked rows must get exactly 0 gradient"


@pytest.mark.usefixtures("kernel_env")
def test_reference_matches_eager_log_softmax():
    """The float64 reference itself against the textbook formula, unmasked."""
    logits, tokens, _ = make_inputs(16, 50, torch.float64, masked=False)
    x = logits.clone().requires_grad_()
    got = kernels.token_logprobs(x, tokens, 0.7, backend="torch")
    lp_all = torch.log_softmax(x / 0.7, dim=-1)
    want = [lp_all.gather(1, tokens[:, None]).squeeze(1), -(lp_all.exp() * lp_all).sum(-1)]
    for g, w, name in zip(got, want, ["logp", "entropy"]):
        close(g, w, rtol=1e-12, atol=1e-12, what=name)  # both float64
    upstream = [torch.randn(16, dtype=torch.float64) for _ in range(2)]
    close(grads_of(got, [x], upstream)[0], grads_of(want, [x], upstream)[0], rtol=1e-10, atol=1e-12, what="d logits")


@pytest.mark.usefixtures("kernel_env")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_large_magnitude_logits(backend):
    logits, tokens, mask = make_inputs(32, V, torch.float32, scale=1e3, offset=1e4)
    x_ref, want = reference(logits, tokens, 0.7, mask=mask)
    x = logits.clone().requires_grad_()
    got = kernels.token_logprobs(x, tokens, 0.7, mask=mask, backend=backend)
    for g, w, name in zip(got, want, ["logp", "entropy"]):
        # x - max(x) is exact in fp32, so only fp32 rounding relative to the result remains (|logp| up to ~1e4)
        close(g, w, rtol=1e-5, atol=1e-5, what=name)
    upstream = [torch.randn(tokens.shape, dtype=torch.float64) for _ in range(2)]
    close(grads_of(got, [x], upstream)[0], grads_of(want, [x_ref], upstream)[0], rtol=1e-4, atol=1e-5,
          what="d logits")  # as in the fp32 test above


@pytest.mark.usefixtures("kernel_env")
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kept_set(backend, dtype):
    n, k = 40, 300  # K > BLOCK: the kept loop also runs several blocks
    logits, tokens, mask = make_inputs(n, V, dtype)
    kept = make_kept(tokens, V, k)
    x = logits.clone().requires_grad_()
    got = kernels.token_logprobs(x, tokens, 0.7, mask=mask, kept_ids=kept, backend=backend)
    # Reference 1: the float64 kept path. Reference 2: the dense float64 path on logits that are -inf outside the
    # kept set, i.e. the definition of "renormalised over the kept set".
    x_ref, want = reference(logits, tokens, 0.7, mask=mask, kept_ids=kept)
    masked_logits = torch.full(logits.shape, float("-inf"), dtype=torch.float64)
    outside = torch.ones(logits.shape, dtype=torch.bool)  # where the gradient must be exactly 0
    for i in torch.where(mask)[0]:
        ids = kept[i][kept[i] >= 0]
        masked_logits[i, ids] = logits[i, ids].double()
        outside[i, ids] = False
    x_dense, want_dense = reference(masked_logits, tokens, 0.7, mask=mask)
    upstream = [torch.randn(n, dtype=torch.float64) for _ in range(2)]
    d_x, (d_ref,), (d_dense,) = grads_of(got, [x], upstream)[0], grads_of(want, [x_ref], upstream), \
        grads_of(want_dense, [x_dense], upstream)
    for g, w, wd, name in zip(got, want, want_dense, ["logp", "entropy"]):
        close(g, w, rtol=2e-5, atol=2e-5, what=name)  # fp32 math on exact inputs
        close(w, wd, rtol=1e-10, atol=1e-10, what=name + " (kept path vs -inf masked dense)")
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)  # bf16-stored grads
    close(d_x, d_ref, what="d logits", **tol)
    close(d_ref, d_dense, rtol=1e-10, atol=1e-12, what="d logits (kept vs dense)")
    assert (d_x[outside] == 0).all(), "gradient outside the kept set (and at masked rows) must be exactly 0"


@pytest.mark.usefixtures("kernel_env")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_kept_set_without_sampled_token_is_minus_inf(backend):
    logits, tokens, _ = make_inputs(12, V, torch.float32, masked=False)
    kept = make_kept(tokens, V, 20, drop_sampled={3, 7})
    x = logits.clone().requires_grad_()
    logp, ent = kernels.token_logprobs(x, tokens, kept_ids=kept, backend=backend)
    assert torch.isneginf(logp[[3, 7]]).all() and torch.isfinite(logp[[0, 1, 2, 4, 5, 6]]).all()
    assert torch.isfinite(ent).all()
    (d_x,) = torch.autograd.grad(ent.sum(), x)  # the entropy stays differentiable
    assert torch.isfinite(d_x).all()


@pytest.mark.usefixtures("kernel_env")
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("inplace", [False, True])
def test_noncontiguous_btv_slice(backend, inplace):
    B, T, vocab = 3, 9, 300
    base = torch.randn(B, T, vocab, requires_grad=True)
    seq = torch.randint(0, vocab, (B, T))
    tokens, mask = seq[:, 3:], torch.rand(B, T - 3) > 0.2          # the tokens that logits[:, 2:-1] predict
    logits = (base * 1)[:, 2:-1]                                   # (B, T-3, V), rows not mergeable into one stride
    assert not logits.is_contiguous()
    got = kernels.token_logprobs(logits, tokens, 0.7, mask=mask, backend=backend, inplace_backward=inplace)
    x_ref = base.detach().double().requires_grad_()
    want = kernels.token_logprobs(x_ref[:, 2:-1], tokens, 0.7, mask=mask, backend="torch")
    for g, w, name in zip(got, want, ["logp", "entropy"]):
        assert g.shape == (B, T - 3)
        close(g, w, rtol=2e-5, atol=2e-5, what=name)  # fp32 vs float64
    upstream = [torch.randn(B, T - 3, dtype=torch.float64) for _ in range(2)]
    close(grads_of(got, [base], upstream)[0], grads_of(want, [x_ref], upstream)[0], rtol=1e-4, atol=1e-5,
          what="d logits")


@pytest.mark.usefixtures("kernel_env")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_no_grad_scoring_path(backend):
    logits, tokens, mask = make_inputs(20, V, torch.float32)
    with torch.no_grad():
        got = kernels.token_logprobs(logits.requires_grad_(), tokens, mask=mask, backend=backend)
    assert all(o.grad_fn is None for o in got)
    _, want = reference(logits, tokens, 1.0, mask=mask)
    for g, w in zip(got, want):
        close(g, w, rtol=2e-5, atol=2e-5, what="no-grad output")  # fp32 vs float64


@pytest.mark.usefixtures("kernel_env")
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("use_kept", [False, True])
def test_linear_matches_reference(backend, dtype, use_kept):
    B, T, H, vocab = 2, 21, 32, 300
    hidden = torch.randn(B, T, H).to(dtype)
    weight = (torch.randn(vocab, H) / H**0.5 * 2).to(dtype)
    tokens = torch.randint(0, vocab, (B, T))
    mask = torch.rand(B, T) > 0.25
    kept = make_kept(tokens.reshape(-1), vocab, 24).view(B, T, 24) if use_kept else None
    # Reference: the float64 torch path of the full logits, from the same bf16-rounded hidden and weight (masked
    # rows zeroed there, else NaN * 0 would poison d(weight); ours must not even read them).
    h_ref = hidden.double().masked_fill(~mask[..., None], 0.0).requires_grad_()
    w_ref = weight.double().requires_grad_()
    # Our chunks' logits are rounded to the input dtype (as any lm_head output is), so the reference takes those
    # rounded values with the gradient of the exact product (straight-through): it then tests the kernels, not the
    # precision of bf16 logits. The same values: ours multiplies the real rows in chunks of 8, and a GEMM's bf16
    # result can depend on its row count (cuBLAS picks its kernel by shape), so the reference's chunks are those.
    real = hidden[mask]                                                                 # (n, H)
    rounded = torch.zeros(B, T, vocab, dtype=dtype)
    rounded[mask] = torch.cat([real[r0:r0 + 8] @ weight.T for r0 in range(0, len(real), 8)])
    logits_ref = h_ref @ w_ref.T
    logits_ref = logits_ref + (rounded.double() - logits_ref).masked_fill(~mask[..., None], 0.0).detach()
    want = kernels.token_logprobs(logits_ref, tokens, 0.7, mask=mask, kept_ids=kept, backend="torch")
    hidden[~mask] = float("nan")  # masked rows' hidden states are garbage: never multiplied
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got = kernels.linear_token_logprobs(h, w, tokens, 0.7, mask=mask, kept_ids=kept, backend=backend, chunk_tokens=8)
    for g, wv, name in zip(got, want, ["logp", "entropy"]):
        assert g.shape == (B, T)
        close(g, wv, rtol=2e-5, atol=2e-5, what=name)  # the same rounded logits: fp32 math, ~1e-6
        assert (g[~mask] == 0).all()
    upstream = [torch.randn(B, T, dtype=torch.float64) for _ in range(2)]
    d_h, d_w = grads_of(got, [h, w], upstream)
    d_h_ref, d_w_ref = grads_of(want, [h_ref, w_ref], upstream)
    # fp32: ~1e-6 after the matmuls; bf16: d(logits) is stored in bf16 and both matmuls round their outputs to
    # bf16 (2^-9 each), so 2e-2 of the largest entry
    gtol = 1e-4 if dtype == torch.float32 else 2e-2
    for got_g, want_g, name in ((d_h, d_h_ref, "d hidden"), (d_w, d_w_ref, "d weight")):
        close(got_g, want_g, rtol=gtol, atol=gtol * float(want_g.abs().max()), what=name)
    assert (d_h[~mask] == 0).all(), "masked rows must get exactly 0 gradient"


@pytest.mark.usefixtures("kernel_env")
def test_linear_all_rows_masked_and_no_grad():
    hidden, weight = torch.randn(5, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True)
    tokens, mask = torch.randint(0, 30, (5,)), torch.zeros(5, dtype=torch.bool)
    logp, ent = kernels.linear_token_logprobs(hidden, weight, tokens, mask=mask)
    assert (logp == 0).all() and (ent == 0).all()
    (logp + ent).sum().backward()
    assert (hidden.grad == 0).all() and (weight.grad == 0).all()
    with torch.no_grad():
        logp, ent = kernels.linear_token_logprobs(hidden, weight, tokens)
    assert logp.grad_fn is None
    close(logp, kernels.token_logprobs(hidden.detach() @ weight.detach().T, tokens)[0], rtol=1e-5, atol=1e-5,
          what="no-grad linear")  # fp32 both



def no_c_compiler(*args):  # what Triton's first compile raises on a machine without a C compiler
    raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable or set triton.knobs.")


def test_triton_kernels_that_cannot_compile_fall_back_to_the_torch_path(monkeypatch, capsys):
    device = torch.device(KERNEL_DEVICE)  # (CPU: the Triton interpreter)
    kernels.triton_works.cache_clear()
    try:
        assert kernels.triton_works(device)
        kernels.triton_works.cache_clear()
        monkeypatch.setattr(kernels, "_launch", no_c_compiler)
        with pytest.raises(RuntimeError, match="STRICT=1: Triton kernels off \\(Failed to find C compiler"):
            kernels.triton_works(device)
        monkeypatch.delenv("PPO_TOKENS_STRICT")
        assert not kernels.triton_works(device)
        assert "the torch path. Triton compiles with a C compiler and the Python development headers" in \
            capsys.readouterr().out
    finally:
        kernels.triton_works.cache_clear()


def test_two_threads_never_launch_a_triton_kernel_at_once(monkeypatch):
    """Triton compiles a kernel variant at its first launch, which is not thread-safe: launches take turns."""
    kernel, spans, barrier = kernels._logprob_fwd_kernel, [], threading.Barrier(2)

    class Launches:  # kernel[grid](...), timed, with a pause: two launches at once would overlap
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                start = time.perf_counter()
                time.sleep(0.2)
                kernel[grid](*args, **kwargs)
                spans.append((start, time.perf_counter()))
            return launch
    monkeypatch.setattr(kernels, "_logprob_fwd_kernel", Launches())
    logits, tokens = torch.randn(3, 40, device=KERNEL_DEVICE), torch.zeros(3, dtype=torch.long, device=KERNEL_DEVICE)

    def score():
        barrier.wait()
        kernels.token_logprobs(logits, tokens, backend="triton")
    threads = [threading.Thread(target=score) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (_, first_end), (second_start, _) = sorted(spans)
    assert first_end <= second_start


def test_a_script_in_this_directory_loads_a_model_with_the_hubs_kernels_package(tmp_path):
    """kernels.py shares its name with the Hugging Face Hub's `kernels` package, which transformers imports: a user's
    script run in this directory (where `import kernels` finds our file first) must still load a model."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    script = f"import transformers; transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})"
    copy, renamed = tmp_path / "copy", tmp_path / "renamed"  # a second copy of the project on sys.path (it once
    for folder, name in ((copy, "ppo_tokens.py"), (renamed, "my_ppo.py")):  # handed the name back: a recursion); a
        folder.mkdir()  # researcher's renamed copy, run in its own folder
        shutil.copy(os.path.join(HERE, "kernels.py"), folder)
        shutil.copy(os.path.join(HERE, "ppo_tokens.py"), folder / name)
    (renamed / "load.py").write_text(script)
    runs = [subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
            for argv, cwd, env in (([sys.executable, "-c", script], HERE, None),
                                   ([sys.executable, "-c", script], HERE, {**os.environ, "PYTHONPATH": str(copy)}),
                                   ([sys.executable, "load.py"], renamed, None))]  # (at once: each is an import)
    try:
        for run in runs:
            stderr = run.communicate(timeout=300)[1]
            assert run.returncode == 0, stderr[-3000:]
    finally:  # (none left running after a failure)
        for run in runs:
            run.kill()

# ---------------------------------------------------------------------------------------------------------------
# CUDA: the GPU-only paths, run when CUDA exists (skipped otherwise). PPO_TOKENS_STRICT=1 (set above, inherited by
# every subprocess) makes a fast path that falls back (fast sampler, CUDA graph, compile, flash-attn, fused head) an
# error, so these cannot pass on the slow path. The bit-exact tests above stay on the CPU; these use tolerances.

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA_LOOP = [*LOOP, "--device", "cuda", "--steps", "3"]  # (the last --device wins)


def run_cuda_script(args, cwd):  # a process of its own: a CUDA run's device, TF32 setting, graphs and memory stay there
    proc = run_raw(args, cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def cuda_records(output_dir, steps, ratio_tol=1e-3):
    records = [r for r in read_metrics(output_dir) if r["step"] > 0]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert all(math.isfinite(r[k]) for k in ("reward_mean", "kl", "entropy", "pg_loss", "vf_loss", "grad_norm"))
        assert r["first_ratio_max_dev"] <= ratio_tol and r["weight_sync_ms"] >= 0
        assert 0 < r["peak_memory_gb"] <= torch.cuda.get_device_properties(0).total_memory / 2**30  # this iteration's
        # the bf16 sampler against the fp32 trainer, on the same weights (a stale token differs by the update too)
        assert r["behav_prox_max_diff"] < 0.5 or r["staleness_max"] > 0
    return records


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_multi_turn_copies_observations_once_a_turn_and_grows_the_static_cache_to_long_first_observations(
        tmp_path, device, monkeypatch):
    """The GPU review's multi-turn findings. Observations go to the device in one copy a turn, not one a row: the count
    of host-to-device transfers does not grow with the rows. A reset() observation longer than every prompt (which
    sized the static cache) grows the sampler's static cache once, said in one line, and never falls back to the
    plain loop (PPO_TOKENS_STRICT: a fall-back is an error). The environment threads run on the run's device."""
    tokenizer = pt.build_demo_tokenizer(hints=True)
    policy = tiny_llama(len(tokenizer), seed=3, max_position_embeddings=256).to(device)
    to, tensor, transfers = torch.Tensor.to, torch.tensor, []

    def spy_to(self, *args, **kwargs):  # ppo_tokens.py sends a host tensor to the run's device
        if self.device.type == "cpu" and torch.device(device).type in [a.type for a in (*args, *kwargs.values())
                                                                       if isinstance(a, torch.device)]:
            transfers.append(sys._getframe(1).f_code.co_filename == pt.__file__)
        return to(self, *args, **kwargs)

    def spy_tensor(data, *args, **kwargs):  # ppo_tokens.py makes a tensor from host data on the run's device
        if "device" in kwargs and torch.device(kwargs["device"]).type == torch.device(device).type:  # (cuda:0 too)
            transfers.append(sys._getframe(1).f_code.co_filename == pt.__file__)
        return tensor(data, *args, **kwargs)

    counts = []
    for rows in (4, 12):
        texts = [f"{a}+{a}=" for a in range(10, 10 + rows)]
        cfg = pt.Config(response_length=40, max_turns=3, temperature=1.0, chat_template=False)
        args = pt.sampling_args(cfg, tokenizer.pad_token_id, [tokenizer.eos_token_id], vocab=len(tokenizer))
        generator = torch.Generator(device).manual_seed(0)
        transfers.clear()
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "to", spy_to)
            m.setattr(torch, "tensor", spy_tensor)
            batch = pt.run_episodes(policy, [ScriptedEnv() for _ in texts], texts, list(range(rows)), tokenizer,
                                    cfg, None, **args, generator=generator)
        assert int(batch.context_mask.sum()) > int(batch.response_mask.sum())  # observations were appended
        counts.append((sum(transfers), len(batch.episodes["rewards"][0])))
    assert counts[0] == counts[1] and counts[0][0] > 0  # as many transfers for 12 rows as for 4 (in as many turns)

    (tmp_path / "long_reset.py").write_text(  # the first observation: the question four times
        "import threading, torch\n"
        "class LongReset:\n"
        "    def reset(self, prompt, seed=None):\n"
        "        return prompt * 4, {}\n"
        "    def step(self, action, ended=True):\n"
        "        name = threading.current_thread().name\n"
        "        where = torch.cuda.current_device() if torch.cuda.is_available() else -1\n"
        "        open('steps.txt', 'a').write(f'{name} {where}\\n')\n"
        "        return '', 1.0, True, False, {}\n")
    target = f"cuda:{torch.cuda.device_count() - 1}" if device == "cuda" else "cpu"
    run = run_raw if device == "cuda" else run_main  # (CUDA: a process of its own)
    out = run(["--env", "long_reset:LongReset", "--batch-size", "8", "--minibatches", "2", "--steps", "2",
               "--demo-warmup-steps", "0", "--eval-size", "40", "--sample-every", "0", "--device", target,
               "--output-dir", "run"], tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.count("the sampler's static cache grows to them") == 1  # once, then it fits
    steps = [line.split() for line in (tmp_path / "steps.txt").read_text().splitlines()]
    assert any(name.startswith("ppo_tokens-env") for name, _ in steps)  # (the held-out episodes: the main thread)
    if device == "cuda":  # each environment thread on the run's device, not on cuda:0
        assert all(int(where) == torch.device(target).index for _, where in steps)


@cuda
def test_cuda_native_bf16_reads_the_runs_own_device():
    """bf16 matmuls in hardware: sm >= 80 on the run's device (not is_bf16_supported(), which counts emulated bf16),
    read without a context on another GPU; --model presets --bf16, refused where it would be emulated."""
    for index in range(torch.cuda.device_count()):
        device = torch.device("cuda", index)
        assert pt.native_bf16(device) == (torch.cuda.get_device_capability(index) >= (8, 0))
    assert pt.make_config(model="m", device="cuda").bf16 and pt.make_config(model="m", device="cuda").dtype == \
        "bfloat16"
    assert not pt.Config(device="cuda").bf16 and pt.Config(device="cuda").dtype == "bfloat16"  # (the frozen models)


@cuda
@pytest.mark.parametrize("flags", [[], ["--max-staleness", "1"], ["--compile-sampler"],
                                   ["--micro-batch-size", "0", "--micro-batch-tokens", "64", "--bf16",
                                    "--gradient-checkpointing", "--max-staleness", "1"],
                                   ["--lora-rank", "4"], ["--lora-rank", "4", "--bf16", "--max-staleness", "1"]],
                         ids=["sync", "staleness1", "compiled", "packed-bf16-checkpointed", "lora", "lora-bf16"])
def test_cuda_entry_point_trains(tmp_path, flags):
    write_reward_module(tmp_path)
    out = run_cuda_script([*CUDA_LOOP, *flags, "--output-dir", str(tmp_path / "run")], tmp_path)
    assert "on cuda:0" in out  # (and no fast path fell back: under the strict switch that fails the run)
    cuda_records(tmp_path / "run", 3, ratio_tol=1e-3 if "--bf16" not in flags else 1e-2)


@cuda
def test_cuda_offload_ends_with_the_weights_of_a_resident_run(tmp_path, tokenizer):
    """--offload: the frozen reference and reward model bring each layer in from pinned host memory for its forward,
    and Adam's moments wait there between steps; the run ends with a resident run's weights (to CUDA's nondeterministic
    backward: to the bit on a CPU, test_offload_on_a_cpu_...), and an offloaded run resumed from its checkpoint with
    its own (a resume once loaded zeros for the moments)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForSequenceClassification
    rm = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=64, num_labels=1,
                                                    pad_token_id=tokenizer.pad_token_id))
    rm.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    base = [*CUDA_LOOP, "--reward", "", "--reward-model", str(tmp_path / "rm"), "--max-staleness", "1",
            "--save-every", "2"]  # (a checkpoint reads the moments on the host: checkpoint_state syncs for it)
    for name, flags in (("resident", []), ("offloaded", ["--offload"]),
                        ("inline", ["--offload", "--max-staleness", "0"])):  # (a resume at staleness 0 is exact)
        out = run_cuda_script([*base, *flags, "--output-dir", str(tmp_path / name)], tmp_path)
        cuda_records(tmp_path / name, 3)
    assert "Adam at a step" in out and "memory on the host (--offload)" in out and "critic from the reward model" in out
    shutil.copytree(tmp_path / "inline", tmp_path / "resumed", ignore=shutil.ignore_patterns("policy"))
    out = run_cuda_script(["--resume", str(tmp_path / "resumed/checkpoints/step-00000002"), "--output-dir",
                           str(tmp_path / "resumed")], tmp_path)
    assert "step-00000002 after iteration 2/3" in out
    staleness = [[r.get("staleness_max") for r in read_metrics(tmp_path / d)] for d in ("resident", "offloaded")]
    assert staleness[0] == staleness[1]  # (at --max-staleness 1 a timing difference, not offload, would change this)
    for ours, theirs in (("resident", "offloaded"), ("inline", "resumed")):
        a, b = (AutoModelForCausalLM.from_pretrained(tmp_path / d / "policy").state_dict() for d in (ours, theirs))
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=f"{theirs}: {name}")


@cuda
def test_cuda_critic_free_run_with_the_mismatch_correction(tmp_path):  # the bf16 sampler's drift, corrected
    write_reward_module(tmp_path)
    run_cuda_script([*CUDA_LOOP, "--advantage", "grpo", "--samples-per-prompt", "4", "--mismatch-correction",
                     "--output-dir", str(tmp_path / "run")], tmp_path)
    records = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r[k]) for r in records for k in ("pg_loss", "kl_loss", "grad_norm", "behav_prox_kl"))
    assert all("vf_loss" not in r and r["is_weight_mean"] != 1.0 for r in records)  # fresh tokens weighted too


@cuda
def test_cuda_dynamic_sampling_and_environments_run_in_the_sampler_thread(tmp_path):
    """The rows dynamic sampling takes and concatenates, and the environments' episodes (their pool threads set the
    device; a long first observation regrows the static cache), made on the sampler thread's stream and read on the
    trainer's (record_stream)."""
    write_reward_module(tmp_path)
    run_cuda_script([*CUDA_LOOP, "--advantage", "grpo", "--samples-per-prompt", "4", "--dynamic-sampling", "1",
                     "--max-staleness", "1", "--output-dir", str(tmp_path / "dynamic")], tmp_path)
    assert all("sampling_rounds" in r for r in read_metrics(tmp_path / "dynamic") if r["step"] > 0)
    run_cuda_script([*ENV_RUN, "--device", "cuda", "--max-staleness", "1", "--output-dir", str(tmp_path / "env")],
                    tmp_path)
    assert all(r["turns_mean"] >= 1 for r in read_metrics(tmp_path / "env") if r["step"] > 0)


@cuda
def test_cuda_save_every_then_resume_samples_the_same_next_batch(tmp_path):
    write_reward_module(tmp_path)
    args = [*CUDA_LOOP, "--steps", "4", "--save-every", "2"]
    run_cuda_script([*args, "--output-dir", str(tmp_path / "full")], tmp_path)
    full = cuda_records(tmp_path / "full", 4)
    run_cuda_script(["--resume", str(tmp_path / "full/checkpoints/step-00000002"),
                     "--output-dir", str(tmp_path / "full")], tmp_path)
    resumed = cuda_records(tmp_path / "full", 4)
    # iteration 3 samples from the checkpoint's weights with its generator states: the same tokens and rewards (later
    # updates may differ in the last bits: CUDA's backward kernels are not deterministic)
    for key in ("reward_mean", "response_tokens"):
        assert resumed[2][key] == full[2][key], key
    assert abs(resumed[2]["kl"] - full[2]["kl"]) < 1e-5


@cuda
def test_cuda_bench_rollout_runs(tmp_path):
    out = run_cuda_script(["--bench-rollout", "--device", "cuda", "--batch-size", "8", "--response-length", "16",
                           "--minibatches", "2", "--demo-hidden", "64", "--demo-layers", "2"], tmp_path)
    assert "StaticDecoder" in out  # (not fallen back to the plain loop)
    assert re.fullmatch(r"sampler vs generate: \d+\.\d\dx", out.strip().splitlines()[-1])


@cuda
@pytest.mark.parametrize("dtype,group", [(torch.float32, 1), (torch.bfloat16, 1), (torch.float32, 3)])
def test_cuda_fast_sampler_replays_a_captured_graph_with_the_plain_loops_tokens(tokenizer, dtype, group, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    policy = pt.cast_parameters(tiny_llama(len(tokenizer), seed=2, dtype=torch.float32).cuda(), dtype)  # GQA: 4 / 2
    texts = ["1+2=", "37+45=", "9+90=", "5+5=", "123+4=", "0+0="]
    if group > 1:  # groups of one prompt (--samples-per-prompt): the prefill runs once per group
        texts = [t for t in texts[:len(texts) // group] for _ in range(group)]
    ids, mask = pt.left_pad(pt.format_prompts(tokenizer, texts, False, 64), tokenizer.pad_token_id, "cuda")
    decoder = pt.fast_decoder(policy, len(texts), ids.shape[1] + 12, pt.PlainDecoder, group=group)
    assert isinstance(decoder, pt.StaticDecoder) and decoder.graph is not None and decoder.grouped
    assert (decoder.shared is not None) == (group > 1)

    def sample(sampler):  # from the same seed each time
        return pt.generate(sampler, ids, mask, max_new_tokens=10, temperature=0.9, stop_ids=tokenizer.eos_token_id,
                           pad_id=tokenizer.pad_token_id, generator=torch.Generator("cuda").manual_seed(7))

    replayed, again = sample(decoder), sample(decoder)  # the second reuses the cache and the graph
    graph, decoder.graph = decoder.graph, None
    eager = sample(decoder)  # the same decoder without its graph
    decoder.graph = graph
    # the replayed graph, after two batches, still agrees
    kernels.agrees_with_plain_loop(decoder, policy, len(texts), pt.PlainDecoder, group)
    if dtype == torch.float32:  # fp32: the same tokens as the plain DynamicCache loop (bf16 could flip a near-tie)
        plain = sample(policy)
        for batch in (replayed, again, eager):
            assert torch.equal(batch.response, plain.response)
            torch.testing.assert_close(batch.behav_logprobs, plain.behav_logprobs, rtol=0, atol=1e-4)


@cuda
def test_cuda_weight_sync_each_thread_times_its_own_copies(tokenizer):
    policy = tiny_llama(len(tokenizer), dtype=torch.float32).cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    sampler, flat = pt.sampler_copy(policy, torch.float32)  # bf16 on CUDA, made in its buffer: no second copy
    assert flat.dtype == torch.bfloat16
    assert torch.cuda.max_memory_allocated() - before < flat.numel() * flat.element_size() + 2**20  # (+ RoPE's)
    sync, stop, stream = pt.WeightSync(policy, flat), threading.Event(), torch.cuda.Stream()

    def sampler_side():
        with torch.cuda.stream(stream):
            for version in range(1, 31):
                sync.wait_for(version, stop)
                sync.pull()

    thread = threading.Thread(target=sampler_side, daemon=True)
    thread.start()
    try:
        for version in range(1, 31):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(1e-3)
            sync.publish(version)
            ms = sync.sync_ms()  # read while the sampler thread copies: floats, never the other thread's events
            assert math.isfinite(ms) and ms >= 0
    finally:
        thread.join(timeout=60)
        stop.set()
    stream.synchronize()
    assert sync.sampler_version == 30
    for p, q in zip(policy.parameters(), sampler.parameters()):
        assert torch.equal(p.to(torch.bfloat16), q)


@cuda
def test_cuda_set_up_sets_the_device_and_the_matmul_precision(tmp_path):
    for flags, tf32 in (([], True), (["--no-tf32"], False)):
        cfg = pt.parse_config([*TINY, "--device", "cuda", *flags, "--output-dir", str(tmp_path / "run")])
        run = pt.setup(cfg)
        assert torch.backends.cuda.matmul.allow_tf32 is tf32 and run.policy.device == torch.device("cuda:0")
        assert torch.cuda.current_device() == 0
        # --dtype auto: the frozen reference in bf16 on CUDA (a third fp32 model's memory otherwise); trained in fp32
        assert {p.dtype for p in run.reference.parameters()} == {torch.bfloat16}
        assert {p.dtype for p in run.policy.parameters()} == {torch.float32}
    if torch.cuda.device_count() > 1:  # --device cuda:1 in one process: Triton, streams, graphs on device 1
        out = run_cuda_script([*TINY, "--device", "cuda:1", "--output-dir", str(tmp_path / "one")], tmp_path)
        assert "on cuda:1" in out


@cuda
@pytest.mark.parametrize("flags", [[], ["--fsdp"], ["--fsdp", "--offload"]], ids=["ddp", "fsdp", "fsdp-offload"])
def test_cuda_torchrun_nccl(tmp_path, flags):  # fsdp-offload: CPUOffloadPolicy on every model, gloo beside NCCL
    write_reward_module(tmp_path)
    for nproc in (1, 2) if torch.cuda.device_count() > 1 else (1,):
        out = torchrun([digest_script(tmp_path), *CUDA_LOOP, "--micro-batch-size", "4", *flags,
                        "--output-dir", str(tmp_path / f"run{nproc}")], tmp_path, nproc=nproc).stdout
        assert len(set(digests(out))) == 1
        assert (f"reference sharded over {nproc} ranks (FSDP2)" in out) == ("--fsdp" in flags)  # (WORLD: inline)
        assert f"trained weights on {'cpu' if '--offload' in flags else 'cuda'}" in out  # (FSDP2's CPUOffloadPolicy)
        cuda_records(tmp_path / f"run{nproc}", 3)


@cuda
def test_cuda_auto_backend_takes_the_torch_path_when_triton_cannot_compile(monkeypatch, capsys):
    monkeypatch.setattr(kernels, "_launch", no_c_compiler)
    monkeypatch.delenv("PPO_TOKENS_STRICT")
    kernels.triton_works.cache_clear()
    try:
        logits, tokens = torch.randn(4, 50, device="cuda"), torch.randint(0, 50, (4,), device="cuda")
        got, want = kernels.token_logprobs(logits, tokens), kernels.token_logprobs(logits, tokens, backend="torch")
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert "Triton kernels off (Failed to find C compiler" in capsys.readouterr().out
    finally:
        kernels.triton_works.cache_clear()


@cuda
def test_cuda_a_flash_attn_that_fails_its_first_call_is_not_used_and_packing_runs_through_sdpa(tmp_path, monkeypatch,
                                                                                              capsys):
    (tmp_path / "flash_attn").mkdir()  # imports, fails at its first call (a wheel without this GPU's kernels)
    (tmp_path / "flash_attn/__init__.py").write_text(
        "def flash_attn_varlen_func(*args, **kwargs):\n"
        "    raise RuntimeError('FlashAttention only supports Ampere GPUs or newer.')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PPO_TOKENS_STRICT")
    kernels.flash_attn_varlen.cache_clear()
    try:
        policy = tiny_llama(16, dtype=torch.float32).cuda()
        assert pt.use_packed_attention(policy.model, bf16=True) == ""  # the SDPA packed path, checked
        assert "flash-attn is installed but does not import or run (FlashAttention only" in capsys.readouterr().out
        assert kernels.flash_attn_varlen() is None
    finally:
        kernels.flash_attn_varlen.cache_clear()
        sys.modules.pop("flash_attn", None)


@cuda
def test_cuda_the_sampler_thread_sets_its_device_first(tmp_path, monkeypatch):
    """--device cuda:N: the sampler thread's CUDA calls must not fall to cuda:0 (a context there, ~0.5 GB)."""
    write_reward_module(tmp_path)
    monkeypatch.chdir(tmp_path)
    device, seen = torch.device(f"cuda:{torch.cuda.device_count() - 1}"), []
    set_device, make_batch = torch.cuda.set_device, pt.make_batch

    def spy_set_device(d):
        seen.append((threading.current_thread().name, "set", torch.device(d)))
        set_device(d)

    def spy_make_batch(*args):
        seen.append((threading.current_thread().name, "current", torch.device("cuda", torch.cuda.current_device())))
        return make_batch(*args)
    monkeypatch.setattr(torch.cuda, "set_device", spy_set_device)
    monkeypatch.setattr(pt, "make_batch", spy_make_batch)
    cfg = pt.parse_config([*LOOP, "--device", str(device), "--steps", "2", "--output-dir", str(tmp_path / "run")])
    run = pt.setup(cfg)
    os.makedirs(cfg.output_dir)
    pt.train(cfg, run, cfg.output_dir, threaded=True)
    in_thread = [s[1:] for s in seen if s[0] == "ppo_tokens-sampler"]
    assert in_thread[0] == ("set", device) and in_thread[1:] == [("current", device)] * 2


def relative_error(a, b):  # in norm: most of the 152k gradients are ~1e-6
    return float((a.double() - b).norm() / b.norm())


@cuda
def test_cuda_triton_kernels_at_full_scale_against_float64(monkeypatch):
    """16k tokens x a 152k vocabulary in bf16 (Qwen's): 2.5e9 logits, so the rows past 14,122 sit beyond int32
    offsets. The forward and the backward against the float64 torch path chunk by chunk; then the fused lm_head path
    (fp32, IEEE matmuls: its chunks' logits then carry no rounding of their own) at the same scale."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    N, V, T = 16384, 152064, 0.9
    assert N * V > 2**31
    g = torch.Generator("cuda").manual_seed(0)
    logits = (torch.randn(N, V, device="cuda", generator=g) * 3).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, V, (N,), device="cuda", generator=g)
    mask = torch.rand(N, device="cuda", generator=g) > 0.1
    upstream = [torch.randn(N, device="cuda", generator=g) for _ in range(2)]
    logp, ent = kernels.token_logprobs(logits, tokens, T, mask=mask, backend="triton")
    (grad,) = torch.autograd.grad((logp * upstream[0] + ent * upstream[1]).sum(), logits)
    for start in range(0, N, 1024):
        rows = slice(start, start + 1024)
        x = logits[rows].detach().double().requires_grad_()
        want = kernels.token_logprobs(x, tokens[rows], T, mask=mask[rows], backend="torch")
        (want_grad,) = torch.autograd.grad((want[0] * upstream[0][rows] + want[1] * upstream[1][rows]).sum(), x)
        close(logp[rows], want[0], rtol=2e-5, atol=2e-5, what=f"logp rows {start}+")
        close(ent[rows], want[1], rtol=2e-5, atol=2e-5, what=f"entropy rows {start}+")
        close(grad[rows], want_grad, rtol=1e-2, atol=1e-4, what=f"d logits rows {start}+")  # stored in bf16
        assert relative_error(grad[rows], want_grad) < 1e-2, start
    del logits, grad, x, want_grad
    H = 896
    hidden = (torch.randn(N, H, device="cuda", generator=g) / 4).requires_grad_()
    weight = (torch.randn(V, H, device="cuda", generator=g) / 4).requires_grad_()
    logp, ent = kernels.linear_token_logprobs(hidden, weight, tokens, T, mask=mask)
    d_hidden, d_weight = torch.autograd.grad((logp * upstream[0] + ent * upstream[1]).sum(), (hidden, weight))
    w64, want_d_weight = weight.detach().double(), torch.zeros(V, H, dtype=torch.float64, device="cuda")
    for start in range(0, N, 1024):
        rows = slice(start, start + 1024)
        h = hidden[rows].detach().double().requires_grad_()
        w = w64.clone().requires_grad_()
        want = kernels.token_logprobs(h @ w.T, tokens[rows], T, mask=mask[rows], backend="torch")
        want_h, want_w = torch.autograd.grad((want[0] * upstream[0][rows] + want[1] * upstream[1][rows]).sum(), (h, w))
        want_d_weight += want_w
        close(logp[rows], want[0], rtol=1e-4, atol=1e-4, what=f"linear logp rows {start}+")
        close(ent[rows], want[1], rtol=1e-4, atol=1e-4, what=f"linear entropy rows {start}+")
        assert relative_error(d_hidden[rows], want_h) < 1e-4, start
    assert relative_error(d_weight, want_d_weight) < 1e-4


# ---------------------------------------------------------------------------------------------------------------
# the variant tables (POLICY_LOSSES: GSPO, CISPO; ADVANTAGES: REINFORCE++) against
# float64 references from the papers, the reward interface's token-level facts, and a new entry in each table


def variant_update(tokenizer, edit_scored=None, **cfg_overrides):
    """One ppo_update with plain SGD (lr 1, no gradient clip: the step is the gradient) of tiny_setup's models on its
    batch, shortened to completions of 1 to 4 tokens; a critic only for an estimator that declares one.
    edit_scored(batch) runs between scoring and the update. Returns (stats, batch, the policy's
    step)."""
    cfg = pt.Config(**{"batch_size": 8, "minibatches": 1, "ppo_epochs": 1, "response_length": 4, "max_grad_norm": 1e9,
                       **cfg_overrides})
    _, policy, reference, critic, batch = tiny_setup(tokenizer)
    critic = critic if pt.ADVANTAGES[cfg.advantage].critic else None
    shorten(batch)
    orders = [torch.randperm(8, generator=torch.Generator().manual_seed(0)) for _ in range(cfg.ppo_epochs)]
    score(batch, policy, reference, critic, lambda b: torch.arange(8.0), cfg, orders[0])
    if edit_scored is not None:
        edit_scored(batch)
    before = [p.detach().clone() for p in policy.parameters()]
    critic_opt = None if critic is None else torch.optim.SGD(critic.parameters(), lr=1.0)
    stats = pt.ppo_update(policy, critic, torch.optim.SGD(policy.parameters(), lr=1.0), critic_opt, batch, cfg, orders)
    return stats, batch, [p.detach() - b for p, b in zip(policy.parameters(), before)]


def test_the_kl_term_and_the_entropy_bonus_step_along_their_own_gradients(tokenizer):
    """loss = policy loss - entropy_coef * H + kl_coef * KL (--kl-in loss), H and KL token means over the loss's
    tokens: with SGD (lr 1) a step less the step without the term is the term's gradient times its coefficient, signed
    to lower the KL and raise the entropy. Half the rows leave the loss (as flat groups do) and count in neither."""
    def leave_half(batch):
        batch.loss_mask[4:] = 0
    grpo = dict(advantage="grpo", samples_per_prompt=4, kl_coef=0.0, edit_scored=leave_half)
    _, batch, without = variant_update(tokenizer, **grpo)
    for coef, sign, term in ((dict(kl_coef=0.3), -1, lambda lp, h: pt.kl_estimate(lp, batch.ref_logprobs, "k3")),
                             (dict(entropy_coef=0.2), 1, lambda lp, h: h)):
        _, _, step = variant_update(tokenizer, **{**grpo, **coef})
        policy = tiny_setup(tokenizer)[1]  # (the same weights as the update's)
        logprobs, entropy = pt.rollout_logprobs(policy, batch, pt.Config(response_length=4))
        pt.masked_mean(term(logprobs, entropy), batch.loss_mask).backward()
        for p, a, b in zip(policy.parameters(), step, without, strict=True):
            torch.testing.assert_close(a - b, sign * next(iter(coef.values())) * p.grad, rtol=1e-3, atol=1e-6)
        assert max(float(g.abs().max()) for g in (p.grad for p in policy.parameters())) > 1e-4


def stale_old_logprobs(batch):  # an "old" policy that is not the current one: ratios far enough from 1 to be clipped
    noise = torch.randn(batch.old_logprobs.shape, generator=torch.Generator().manual_seed(3))
    batch.old_logprobs = batch.old_logprobs + 0.3 * noise


def random_loss_inputs(seed, B=6, T=7, scale=0.4):
    """float64 (logp (requires grad), old, adv, mask) with rows of 0..T loss tokens, and garbage on the pads (a
    log-ratio of 60 there would overflow any sequence ratio it entered)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 1, 4, 0, 6, 3][:B])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    old = torch.randn(B, T, dtype=torch.float64, generator=g) - 2
    logp = old + scale * torch.randn(B, T, dtype=torch.float64, generator=g)
    logp = torch.where(mask.bool(), logp, 30.0).requires_grad_()
    old = torch.where(mask.bool(), old, -30.0)
    return logp, old, torch.randn(B, T, dtype=torch.float64, generator=g), mask


@pytest.mark.parametrize("eps,eps_high", [(0.2, 0.0), (0.05, 0.1), (3e-4, 4e-4)])  # the last: GSPO's clip ranges
def test_gspo_loss_and_gradient_against_a_float64_sequence_ratio_reference(eps, eps_high):
    logp, old, adv, mask = random_loss_inputs(seed=4)
    high = eps_high or eps
    loss, stats = objective(logp, old, adv, mask, policy_loss="gspo", clip_range=eps, clip_range_high=eps_high)
    # GSPO-token (Zheng et al. 2025), term by term: s_i = exp(mean over the row's loss tokens of logp - old_logp),
    # s_it = sg(s_i) pi_it / sg(pi_it) (the value s_i, the gradient s_i * grad logp_it), and the loss
    # -mean_it min(s_it A_it, clip(s_it, 1 - eps, 1 + eps_high) A_it); where the clipped term is the smaller one it is
    # a constant (no gradient)
    terms, clipped = [], []
    for b in range(mask.shape[0]):
        tokens = [t for t in range(mask.shape[1]) if mask[b, t]]
        s = math.exp(sum(float(logp[b, t].detach() - old[b, t]) for t in tokens) / max(1, len(tokens)))
        for t in tokens:
            a = float(adv[b, t])
            s_clipped = min(max(s, 1 - eps), 1 + high)
            clipped.append(s_clipped * a < s * a)
            s_t = s * torch.exp(logp[b, t] - logp[b, t].detach())
            terms.append(torch.tensor(s_clipped * a, dtype=torch.float64) if clipped[-1] else s_t * a)
    expected = -sum(terms) / len(terms)
    assert abs(float(loss.detach()) - float(expected.detach())) < 1e-12
    assert abs(float(stats["clipfrac"]) - sum(clipped) / len(clipped)) < 1e-12 and 0 < sum(clipped) < len(clipped)
    (grad,) = torch.autograd.grad(loss, logp)
    (expected_grad,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-15)
    assert (grad[~mask.bool()] == 0).all() and (grad[mask.bool()] != 0).any()
    # with one advantage per sequence and the paper's normalisation 1/G sum_i 1/|y_i| sum_t (--loss-agg
    # seq-mean-token-mean), GSPO-token is GSPO: the value and the gradient of the sequence objective
    # -1/G sum_i min(s_i A_i, clip(s_i, 1 - eps, 1 + eps_high) A_i), with s_i differentiated as a whole
    seq_adv = adv[:, :1].expand_as(adv)
    cfg = pt.Config(loss_agg="seq-mean-token-mean", policy_loss="gspo", clip_range=eps, clip_range_high=eps_high)
    tokens, denominators, row_weight, _ = pt.loss_denominators(SimpleNamespace(loss_mask=mask),
                                                               [torch.arange(len(mask))], cfg)
    share = pt.Share(tokens[0], denominators[0], row_weight[:, None])
    loss, _ = objective(logp, old, seq_adv, mask, share, policy_loss="gspo", clip_range=eps, clip_range_high=eps_high,
                        loss_agg="seq-mean-token-mean")
    sequences = []
    for b in range(mask.shape[0]):
        tokens = [t for t in range(mask.shape[1]) if mask[b, t]]
        if tokens:
            s = torch.exp(sum(logp[b, t] - old[b, t] for t in tokens) / len(tokens))
            a, s_clipped = float(adv[b, 0]), min(max(float(s.detach()), 1 - eps), 1 + high)
            unclipped = s_clipped * a >= float(s.detach()) * a
            sequences.append(s * a if unclipped else torch.tensor(s_clipped * a, dtype=torch.float64))
    expected = -sum(sequences) / len(sequences)
    # (to float32 precision: loss_denominators' row weights 1 / |y_i| are float32)
    assert math.isclose(float(loss.detach()), float(expected.detach()), rel_tol=1e-7)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(expected, logp)[0],
                               rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("eps_high", [0.0, 0.28])
def test_cispo_loss_and_gradient_against_a_float64_reference(eps_high):
    logp, old, adv, mask = random_loss_inputs(seed=5)
    eps = 0.2
    high = eps_high or eps
    loss, stats = objective(logp, old, adv, mask, policy_loss="cispo", clip_range=eps, clip_range_high=eps_high)
    # CISPO (MiniMax-M1, 2025): -1/sum|o_i| sum_it sg(clip(r_it, 1 - eps_low, 1 + eps_high)) A_it log pi_it, its
    # gradient -w_it A_it grad logp_it / N on every loss token, the clipped ones too (PPO's clip drops theirs)
    n, x = int(mask.sum()), logp.detach()
    terms, expected_grad, clipped = [], torch.zeros_like(adv), []
    for b, t in mask.nonzero().tolist():
        r = math.exp(float(x[b, t] - old[b, t]))
        w = min(max(r, 1 - eps), 1 + high)
        clipped.append(w != r)
        terms.append(-w * float(adv[b, t]) * float(x[b, t]))
        expected_grad[b, t] = -w * float(adv[b, t]) / n
    assert abs(float(loss.detach()) - sum(terms) / n) < 1e-12
    assert abs(float(stats["clipfrac"]) - sum(clipped) / n) < 1e-12 and 0 < sum(clipped) < n
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-15)
    assert (grad[mask.bool()] != 0).all()  # no token loses its gradient ...
    ppo, _ = objective(logp, old, adv, mask, clip_range=eps, clip_range_high=eps_high)
    assert (torch.autograd.grad(ppo, logp)[0][mask.bool()] == 0).any()  # ... where PPO's clip does drop some


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gspo_and_cispo_updates_are_the_same_however_the_minibatch_is_split(tokenizer, policy_loss, agg):
    runs = [variant_update(tokenizer, stale_old_logprobs, policy_loss=policy_loss, loss_agg=agg, micro_batch_size=m,
                           clip_range=0.1) for m in (0, 4, 2)]  # one micro-batch, two, four
    (stats, _, whole), *splits = runs
    assert 0 < stats["clipfrac"] < 1 and max(float(s.abs().max()) for s in whole) > 1e-4
    for split_stats, _, step in splits:
        for a, b in zip(whole, step):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
        for key in ("pg_loss", "clipfrac", "vf_loss"):
            assert math.isclose(split_stats[key], stats[key], rel_tol=1e-5, abs_tol=1e-7), key
    _, _, ppo = variant_update(tokenizer, stale_old_logprobs, loss_agg=agg, clip_range=0.1)
    assert not all(torch.allclose(a, b) for a, b in zip(ppo, whole))  # the table's loss was the one used


def test_reinforce_pp_advantages_are_whitened_returns_to_go_against_a_float64_loop():
    g = torch.Generator().manual_seed(6)
    B, T, gamma, kl_coef = 5, 7, 0.9, 0.05
    lengths = [7, 1, 4, 6, 2]
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    scores = torch.randn(B, dtype=torch.float64, generator=g)
    kl = torch.where(mask.bool(), torch.randn(B, T, dtype=torch.float64, generator=g), 1e6)  # garbage on pads
    batch = SimpleNamespace(rewards=pt.per_token_rewards(scores, kl, mask, kl_coef), response_mask=mask)
    advantages, returns = pt.ADVANTAGES["reinforce++"].fn(batch, pt.Config(advantage="reinforce++", gamma=gamma))
    # REINFORCE++ (Hu 2025): r_t = score * [t is the last real token] - kl_coef * kl_t, G_t = sum_{k >= t}
    # gamma^(k-t) r_k, whitened over every real token of the batch (unbiased variance)
    G = {}
    for b, n in enumerate(lengths):
        r = [-kl_coef * float(kl[b, k]) + (float(scores[b]) if k == n - 1 else 0.0) for k in range(n)]
        for t in range(n):
            G[b, t] = sum(gamma ** (k - t) * r[k] for k in range(t, n))
    mean, var = statistics.fmean(G.values()), statistics.variance(G.values())
    for b in range(B):
        for t in range(T):
            want = (G[b, t] - mean) / math.sqrt(var + 1e-8) if t < lengths[b] else 0.0
            assert abs(float(advantages[b, t]) - want) < 1e-12, (b, t)
    assert returns is None


def test_reinforce_pp_needs_no_critic_nor_groups_and_micro_batches_score_the_same(tokenizer, tmp_path):
    estimator = pt.ADVANTAGES["reinforce++"]
    assert not estimator.critic and not estimator.groups and estimator.kl_in == "reward"
    cfg = pt.parse_config(["--advantage", "reinforce++", "--samples-per-prompt", "1"])  # accepted: no groups needed
    assert cfg.kl_in == "reward" and cfg.kl_estimator == "k1" and cfg.ppo_epochs == 1
    run = pt.setup(pt.Config(advantage="reinforce++", demo_warmup_steps=0, demo_cache=str(tmp_path), eval_size=40,
                             device="cpu"))
    assert run.critic is None  # setup built no critic
    results = [variant_update(tokenizer, advantage="reinforce++", kl_coef=0.1, gamma=0.9, micro_batch_size=m)
               for m in (0, 2)]
    (stats, batch, whole), (split_stats, split_batch, split) = results
    assert "vf_loss" not in stats and batch.returns is None
    torch.testing.assert_close(split_batch.advantages, batch.advantages, rtol=1e-5, atol=1e-6)
    for a, b in zip(whole, split):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    assert math.isclose(split_stats["pg_loss"], stats["pg_loss"], rel_tol=1e-5, abs_tol=1e-7)
    # the scored batch against a float64 loop: the score on the last real token, -0.1 * k1 on each, returns-to-go
    # (gamma 0.9), whitened over the whole batch's real tokens
    lengths = batch.response_mask.sum(1).tolist()
    kl = (batch.old_logprobs - batch.ref_logprobs).double()
    G = {}
    for b, n in enumerate(lengths):
        r = [-0.1 * float(kl[b, k]) + (float(batch.scores[b]) if k == n - 1 else 0.0) for k in range(n)]
        for t in range(n):
            G[b, t] = sum(0.9 ** (k - t) * r[k] for k in range(t, n))
    mean, std = statistics.fmean(G.values()), statistics.stdev(G.values())
    want = torch.zeros_like(kl)
    for (b, t), g in G.items():
        want[b, t] = (g - mean) / std
    torch.testing.assert_close(batch.advantages.double(), want, rtol=1e-5, atol=1e-5)


def test_reward_functions_get_the_token_facts_they_name_and_the_demo_reward_is_one(tokenizer, tmp_path, monkeypatch):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    digit = {str(d): tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    rows = [["3", eos, pad], ["3", "3", "3"], ["5", eos, pad], ["1", "0", eos]]  # the second hit the length limit
    response = torch.tensor([[digit.get(x, x) for x in row] for row in rows])
    batch = pt.Rollout(None, None, response, (response != pad).long(), None, None,
                       torch.tensor([True, False, True, True]), prompts=["1+2=", "100+233=", "2+2=", "5+5="])
    batch.completions = pt.decode_completions(tokenizer, batch)
    assert batch.completions == ["3", "333", "5", "10"]
    ids = [[digit["3"]], [digit["3"]] * 3, [digit["5"]], [digit["1"], digit["0"]]]  # the stop token excluded
    seen = {}

    def named(prompts, completions, completion_ids, ended):
        seen["named"] = dict(completion_ids=completion_ids, ended=ended)
        return [1.0] * len(completions)

    def only_ended(prompts, completions, ended):
        seen["only_ended"] = dict(ended=ended)
        return [2.0] * len(completions)

    def any_facts(prompts, completions, **facts):
        seen["any_facts"] = facts
        return [3.0] * len(completions)

    def plain(prompts, completions):
        seen["plain"] = dict(prompts=prompts, completions=completions)
        return [float(len(c)) for c in completions]

    for rule in (named, only_ended, any_facts, plain):
        assert pt.rule_scores(rule, batch).dtype == torch.float32
    facts = dict(completion_ids=ids, ended=[True, False, True, True])
    assert seen["named"] == facts and seen["any_facts"] == facts and seen["only_ended"] == dict(ended=facts["ended"])
    assert seen["plain"] == dict(prompts=batch.prompts, completions=batch.completions)
    assert pt.rule_scores(plain, batch).tolist() == [1.0, 3.0, 1.0, 2.0]
    # the demo's reward is a --reward function like these: "333" is the sum of 100 + 233, but without its stop token
    assert pt.rule_scores(pt.addition_reward, batch).tolist() == [1.0, 0.0, 0.0, 1.0]
    (tmp_path / "facts.py").write_text("def score(prompts, completions, **facts):\n"
                                       "    pairs = zip(facts['completion_ids'], facts['ended'])\n"
                                       "    return [len(ids) + ended for ids, ended in pairs]\n")
    monkeypatch.chdir(tmp_path)
    demo, user = (pt.setup(pt.Config(reward=reward, demo_warmup_steps=0, demo_cache=str(tmp_path), eval_size=40,
                                     device="cpu")) for reward in ("", "facts:score"))  # setup's reward_fn
    assert demo.reward_fn.func is pt.rule_scores and demo.reward_fn.args == (pt.addition_reward,)
    assert demo.reward_fn(batch).tolist() == [1.0, 0.0, 0.0, 1.0]
    assert user.reward_fn.func is pt.rule_scores and user.reward_fn(batch).tolist() == [2.0, 3.0, 2.0, 3.0]


def test_a_new_loss_and_estimator_are_one_function_and_one_table_entry_each(tokenizer, monkeypatch, tmp_path):
    calls = []

    def doubled_ppo(logprobs, mb, cfg):  # a new policy loss: twice PPO's
        calls.append("loss")
        token_loss, stats = pt.ppo_loss(logprobs, mb, cfg)
        return 2 * token_loss, stats

    def ones(batch, cfg):  # a new estimator: every real token's advantage is 1, no critic
        calls.append("advantages")
        return batch.response_mask.to(batch.rewards.dtype), None

    monkeypatch.setitem(pt.POLICY_LOSSES, "doubled", pt.PolicyLoss(doubled_ppo, loss_agg="token-mean"))
    monkeypatch.setitem(pt.ADVANTAGES, "ones", pt.Estimator(ones, critic=False, groups=False, kl_in="loss"))
    cfg = pt.make_config(advantage="ones")  # the entry's declarations set the defaults: no critic, the KL in the loss
    assert (cfg.kl_in, cfg.kl_estimator, cfg.ppo_epochs, cfg.steps) == ("loss", "k3", 1, 800)
    stats, batch, step = variant_update(tokenizer, policy_loss="doubled", advantage="ones")
    assert calls == ["advantages", "loss"] and batch.returns is None and "vf_loss" not in stats
    assert torch.equal(batch.advantages, batch.response_mask.float())
    assert math.isclose(stats["pg_loss"], -2, rel_tol=1e-6) and stats["kl_loss"] > 0  # the first minibatch: ratio 1

    def doubled_advantages(b):
        b.advantages = 2.0 * b.response_mask

    # the same step from the built-in entries, the advantages set to what the new entries amount to
    _, _, built_in = variant_update(tokenizer, doubled_advantages, advantage="reinforce++", kl_in="loss",
                                    kl_estimator="k3")
    for a, b in zip(built_in, step):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert max(float(s.abs().max()) for s in step) > 1e-4
    # and a real iteration of train() through both, chosen on the command line (the choices are the tables)
    calls.clear()
    cfg = pt.parse_config(["--policy-loss", "doubled", "--advantage", "ones", "--steps", "1",
                           "--batch-size", "8", "--minibatches", "1", "--response-length", "4", "--eval-size", "40",
                           "--sample-every", "0", "--demo-warmup-steps", "0", "--demo-cache", str(tmp_path),
                           "--device", "cpu"])
    run = pt.setup(cfg)
    assert run.critic is None
    os.makedirs(tmp_path / "run")
    (record,) = pt.train(cfg, run, str(tmp_path / "run"), threaded=False)
    assert calls == ["advantages", "loss"] and "vf_loss" not in record and record["kl_loss"] >= 0


if __name__ == "__main__":  # torchrun test_ppo_tokens.py OUT: the two-rank half of
    # test_whitening_the_first_update_and_sharded_frozen_models_do_not_depend_on_the_world_size
    ctx = pt.init_distributed(pt.Config(device="cpu"))
    results = {}
    for agg in LOSS_AGGS:
        advantages, stats, weights = first_iteration(ctx.world, ctx.rank, agg)
        results[agg] = {"advantages": advantages, "stats": stats, "weights": weights}
    results["global_means"] = pt.global_masked_means([unequal_shares(ctx.rank)])
    group = torch.distributed.new_group(backend="gloo")  # (as the run's producer group)
    results["frozen"] = [pt.gather_objects(frozen_scores(ctx.rank, g)) for g in (None, group)]
    if ctx.rank == 0:
        torch.save(results, sys.argv[1])
    import gc
    gc.collect()  # as ppo_tokens.main: DDP wrappers in reference cycles keep the gloo group alive, which can abort
    torch.distributed.barrier()  # the process at interpreter shutdown; and no rank leaves while another still works
    torch.distributed.destroy_process_group()
