"""ppo_tokens: PPO for language models (RLHF) in one hackable file.

A policy (any Hugging Face causal LM) samples completions with its own KV-cache loop; a frozen reference, a critic
(a value head on a causal-LM backbone) and a reward (a reward model, a Python function, or the demo's rule) score
them; each token's reward is -kl_coef * KL(policy || reference), plus the score on the last real token; GAE gives the
advantages, and the clipped PPO objective updates policy and critic over a few epochs of minibatches. It follows
"The N+ Implementation Details of RLHF with PPO" (Huang et al., 2024) and says where it differs. Each variant is one
function plus one entry in a table: advantage estimators (ADVANTAGES: gae, reinforce++, and the critic-free grpo and
rloo over groups of --samples-per-prompt completions) and policy losses (POLICY_LOSSES: ppo, gspo, cispo).
--max-staleness k: a sampler thread runs up to k policy versions ahead and decoupled PPO corrects for it. --env:
multi-turn episodes with an environment (Gymnasium's reset / step over text), its observations context the loss never
sees. Under torchrun the actor and critic train data-parallel (DDP, or FSDP2).
Left out: pure-bf16 weights (fp32 master weights and AdamW), paged attention / continuous batching in the sampler.

    python ppo_tokens.py                                  # CPU demo: a 0.6M-parameter Llama learns addition
    python ppo_tokens.py --model Qwen/Qwen2.5-0.5B-Instruct --prompts prompts.jsonl --reward-model ./my_rm \\
        --response-length 256 --batch-size 64 --micro-batch-size 8 --lr 1e-6 --critic-lr 1e-5    # one GPU
    python ppo_tokens.py --advantage grpo --samples-per-prompt 8     # the demo, critic-free
    python ppo_tokens.py --env demo                       # the demo, multi-turn: a second try after a hint
    torchrun --standalone --nproc_per_node 8 ppo_tokens.py --model ...  # one node, 8 GPUs (--fsdp to shard)
    python ppo_tokens.py --help                           # every flag, with its units and typical values
README.md gives its numbers with the commands and machines they came from.
"""

import argparse, collections, concurrent.futures, contextlib, copy, dataclasses, functools, gc, hashlib, importlib
import importlib.util, inspect, itertools, json, math, os, queue, random, resource, shutil, signal, sys, threading, time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn

# kernels.py, loaded by path as `ppo_tokens_kernels`: the name `kernels` belongs to the Hugging Face Hub's package,
# which transformers >= 5.25 imports (kernels.py hands the name over when imported by it)
if "ppo_tokens_kernels" not in sys.modules:
    _spec = importlib.util.spec_from_file_location(
        "ppo_tokens_kernels", os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.py"))
    sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[_spec.name])
kernels = sys.modules["ppo_tokens_kernels"]
# the fused log-prob kernels and the fast paths, each checked against its plain path here
from ppo_tokens_kernels import (StaticDecoder, decoder_kwargs, fall_back, fast_decoder, fused_head_agrees,  # noqa: E402
                                linear_token_logprobs, pack_sequences, token_budget_bins, token_logprobs,
                                use_packed_attention)


# ----------------------------------------------------------------------------------------------------------------
# config


def arg(default, help):  # a Config field whose help text is its comment; the CLI is generated from these
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    """Every default below is the value that runs: `python ppo_tokens.py` is the single-turn demo with exactly these.
    PRESETS (below) change some of them for a real model (--model), a critic-free or a multi-turn demo."""
    # what to train
    model: str = arg("", "HF causal-LM directory or hub name; empty = the built-in demo (a tiny Llama learns addition)")
    reward_model: str = arg("", "AutoModelForSequenceClassification (num_labels=1) directory: score = its output")
    reward: str = arg("", "'module:function', (prompts, completions, **facts) -> list[float]; facts: README")
    prompts: str = arg("", "JSONL file, one object per line with a 'prompt' field; empty = the demo's prompts")
    env: str = arg("", "multi-turn: 'module:factory', factory() -> an environment (reset, step: README); or 'demo'")
    max_turns: int = arg(2, "multi-turn (--env): the policy's turns per episode at most")
    env_latency: float = arg(0.0, "multi-turn: seconds each environment step waits first (a tool's latency, to bench)")
    chat_template: bool = arg(True, "wrap each prompt in the tokenizer's chat template when it has one")
    task: str = arg("demo", "'module:factory', factory(cfg) -> Task: prompts, reward, model, warm-up, held-out "
                            "evaluation, each where no flag gives it; 'demo': the built-in addition task; '': none")
    max_prompt_length: int = arg(512, "longest prompt in tokens; longer ones keep their last tokens (warned)")
    # rollout
    steps: int = arg(300, "PPO iterations (a batch and its update each)")
    batch_size: int = arg(256, "completions per iteration (--samples-per-prompt of each prompt)")
    response_length: int = arg(4, "max new tokens per completion (--env: all turns and observations)")
    temperature: float = arg(0.7, "of sampling and scoring (logits / T); > 0: PPO's ratio needs a distribution")
    top_k: int = arg(0, "sample from the k most likely tokens only (0 = off); log-probs renormalise over that set")
    top_p: float = arg(1.0, "nucleus sampling threshold (1 = off); keeps at most --top-k ids, 64 when --top-k is 0")
    # PPO
    ppo_epochs: int = arg(2, "passes over each rollout batch")
    minibatches: int = arg(4, "optimizer steps per epoch; --batch-size must divide by it")
    micro_batch_size: int = arg(0, "rows per forward/backward, gradients accumulate; 0 = the whole minibatch")
    micro_batch_tokens: int = arg(0, "instead: packed micro-batches of at most this many real tokens; 0 = padded rows")
    gradient_checkpointing: bool = arg(False, "recompute each decoder layer's activations in the backward")
    bf16: bool = arg(False, "bf16 autocast over the fp32 master weights (devices with bf16 matmuls); the log-prob and "
                            "value heads stay fp32")
    lr: float = arg(5e-4, "policy learning rate (AdamW)")
    critic_lr: float = arg(1e-3, "critic learning rate (AdamW)")
    lr_decay: bool = arg(True, "decay both learning rates linearly to 0 over --steps")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    adam_eps: float = arg(1e-5, "AdamW epsilon (1e-5 as in the N+ details, not PyTorch's 1e-8)")
    max_grad_norm: float = arg(1.0, "gradient-norm clip, per model (0: no clip, the norm still logged)")
    policy_loss: str = arg("ppo", "POLICY_LOSSES: 'ppo' (clipped ratio per token), 'gspo' (per sequence), 'cispo'")
    clip_range: float = arg(0.2, "PPO ratio clip epsilon")
    clip_range_high: float = arg(0.0, "upper ratio clip: 1 + this (DAPO's clip-higher, e.g. 0.28); 0 = --clip-range")
    value_clip_range: float = arg(0.2, "value-prediction clip around the rollout's values")
    entropy_coef: float = arg(0.0, "entropy bonus in the policy loss (0 = only logged)")
    kl_coef: float = arg(0.02, "weight of the per-token KL(policy || reference) penalty (see --kl-in)")
    kl_in: str = arg("auto", "the KL penalty goes in the 'reward' or the 'loss' (as GRPO); auto: the --advantage's")
    kl_estimator: str = arg("auto", "k1, k2 or k3 (kl_estimate, Schulman 2020); auto: k1 in the reward, k3 in the loss")
    advantage: str = arg("gae", "ADVANTAGES: 'gae' (a critic), 'reinforce++', or over groups 'grpo', 'rloo'")
    samples_per_prompt: int = arg(1, "completions per prompt in a batch (a group); --batch-size counts completions")
    scale_rewards: str = arg("group", "grpo: divide by the std of the 'group', the 'batch', or 'none' (Dr. GRPO)")
    loss_agg: str = arg("auto", "'token-mean', 'seq-mean-token-mean' or 'seq-mean-token-sum-norm'; auto: the "
                                "--policy-loss's (gspo: seq-mean-token-mean, else token-mean)")
    drop_flat_groups: bool = arg(True, "grpo, rloo: groups that all scored the same leave the loss (advantages 0; "
                                       "--kl-in reward: the KL's alone)")
    mismatch_correction: bool = arg(False, "decoupled-PPO weights on fresh tokens too (sampler drift)")
    gamma: float = arg(1.0, "GAE discount")
    lam: float = arg(0.95, "GAE lambda")
    missing_eos_penalty: float = arg(0.0, "subtracted from the score of a completion without EOS (e.g. 1.0)")
    dynamic_sampling: int = arg(0, "DAPO's dynamic sampling: up to this many more rounds of prompts refill a batch "
                                   "with groups that have signal (0 = off)")
    # the overlapped loop (sampler thread + bounded queue + packed weight sync + off-policy correction)
    max_staleness: int = arg(0, "policy versions a batch may lag the trainer: 0 = synchronous, 1 = one-step off-policy")
    is_cap: float = arg(2.0, "cap on the decoupled-PPO importance weight exp(prox_logp - behav_logp) of stale tokens")
    bench_overlap: bool = arg(False, "benchmark: run --steps iterations at --max-staleness 0, 1 and 2, print a table")
    bench_rollout: bool = arg(False, "benchmark: our sampler vs HF generate (tokens/s): plain, static cache, compiled")
    static_cache: bool = arg(True, "sample with a preallocated KV cache (+ CUDA graphs); off = DynamicCache")
    compile_sampler: bool = arg(False, "torch.compile the sampler's steps (CPU: ~10-90 s at start, ~0.16 ms a token "
                                       "less after)")
    full_logits: bool = arg(False, "log-probs from full [tokens, vocab] logits, not the fused lm_head path")
    fsdp: bool = arg(False, "torchrun: shard actor/critic weights, grads, Adam states (FSDP2), not replicate (DDP)")
    lora_rank: int = arg(0, "LoRA (peft): train rank-r adapters over one frozen base that the policy, the reference "
                            "(adapters off) and the critic share; 0 = full fine-tuning")
    lora_alpha: float = arg(32.0, "LoRA: the adapters' scale is alpha / rank")
    lora_targets: str = arg("all-linear", "LoRA: the linear layers adapted, comma-separated module names; 'all-linear'"
                                          " = every one of the decoder (not the output head)")
    offload: bool = arg(False, "CUDA: Adam's moments in pinned host memory between steps (--fsdp: the trained "
                               "weights, gradients and Adam); the frozen reference (a copy) and reward model there "
                               "too, each layer brought in for its forward")
    # the built-in demo (the task at the end of the file)
    demo_warmup_steps: int = arg(1000, "supervised warm-up steps before PPO (0 = none); fixed, past the loss's drop")
    demo_warmup_lr: float = arg(3e-3, "warm-up learning rate (AdamW, betas (0.9, 0.95), 50-step linear warm-up)")
    demo_hidden: int = arg(128, "demo model width (3 layers, 4 heads; 128 = 0.6M parameters)")
    demo_layers: int = arg(3, "demo model depth")
    demo_cache: str = arg("~/.cache/ppo_tokens", "where the warmed-up demo checkpoint is cached between runs")
    eval_every: int = arg(25, "held-out evaluation every this many iterations (a task with one; also before and after)")
    eval_size: int = arg(1000, "held-out prompts per evaluation (the demo)")
    sample_every: int = arg(50, "print a few sample completions every this many iterations (0 = never)")
    # checkpoints and failures
    save_every: int = arg(0, "checkpoint every this many iterations and after the last (0 = only on SIGINT/SIGTERM)")
    keep_checkpoints: int = arg(2, "keep the newest this many checkpoints in --output-dir/checkpoints")
    resume: str = arg("", "bare: the newest checkpoint in --output-dir; PATH: that checkpoint or run directory")
    max_bad_steps: int = arg(3, "stop after this many consecutive updates skipped for non-finite values")
    # run
    seed: int = arg(1, "seeds model init, sampling, data order and minibatch shuffling")
    device: str = arg("auto", "'auto' (cuda if available), 'cpu', 'cuda' or 'cuda:N'")
    dtype: str = arg("auto", "frozen models' dtype (reference, reward model); auto: bfloat16 on CUDA or under --bf16")
    tf32: bool = arg(True, "CUDA: float32 matmuls in TF32 (fp32 sums, several times faster); off = IEEE float32")
    output_dir: str = arg("", "where config.json, metrics.jsonl and policy/ go; empty = runs/<date-time>")
    wandb_project: str = arg("", "log to this Weights & Biases project (off when empty; wandb imported only then)")

    def __post_init__(self):  # the three 'auto' words become what they mean, so config.json logs what ran
        cuda = self.device.startswith("cuda") or (self.device == "auto" and torch.cuda.is_available())
        if self.kl_in == "auto":  # the estimator declares where its KL goes (ADVANTAGES)
            self.kl_in = ADVANTAGES[self.advantage].kl_in if self.advantage in ADVANTAGES else "reward"
        if self.kl_estimator == "auto":  # k1 in the reward; in the loss k3 (k1's expected gradient there is 0)
            self.kl_estimator = "k1" if self.kl_in == "reward" else "k3"
        if self.loss_agg == "auto":  # the policy loss declares its paper's aggregation (POLICY_LOSSES)
            self.loss_agg = POLICY_LOSSES[self.policy_loss].loss_agg if self.policy_loss in POLICY_LOSSES else ""
        if self.dtype == "auto":  # the frozen models in bf16 on CUDA (memory) or under --bf16
            self.dtype = "bfloat16" if cuda or self.bf16 else "float32"


# Presets: a run's defaults other than Config's, applied before the user's flags (a flag given is never replaced);
# presets() chooses them. The demo's values were measured on it (README's results, rows 1-3 and 21).
MODEL = {"task": "",  # the model's own prompts and reward (--prompts, --reward / --reward-model / --env)
         "steps": 1000,
         "batch_size": 64,  # with groups: 64 / --samples-per-prompt prompts
         "response_length": 256,
         "temperature": 1.0,  # sample the model's own distribution
         "ppo_epochs": 1,  # verl's and OpenRLHF's one pass
         "lr": 1e-6, "critic_lr": 1e-5,  # theirs too: the demo's 5e-4 / 1e-3 would wreck a real model in a few updates
         "bf16": True}  # as TRL: bf16 autocast over fp32 weights (refused on a device without bf16 matmuls)
MULTI_TURN_DEMO = {"steps": 100,  # sums below 90 (addition_task): 0.95+ by iteration 75 on the seeds tried
                   "response_length": 16,  # 4 tokens a turn, 8 an observation: 12 x --max-turns - 8 (presets())
                   "temperature": 1.0,  # at 0.7 the end varied 0.78-0.92
                   "kl_coef": 0.1, "clip_range_high": 0.28,  # keep the second tries exploring (without both: seed 2
                   # stalled near 0.80, one hint side lost)
                   "demo_warmup_steps": 1300}  # its second half teaches the conversation's format
CRITIC_FREE_DEMO = {"steps": 800,  # one pass over smaller steps: more iterations to the same accuracy (README row 2)
                    "ppo_epochs": 1,  # GRPO's mu = 1
                    "lr": 3e-4}
GROUPS_DEMO = {"samples_per_prompt": 8, "batch_size": 512}  # 64 prompts x a group of 8
PRESETS = {"--model": MODEL, "multi-turn demo": MULTI_TURN_DEMO, "critic-free demo": CRITIC_FREE_DEMO,
           "grouped demo": GROUPS_DEMO}


def presets(given: dict) -> list:  # [(name, values)] of the PRESETS for a run with these flags given, as applied
    if given.get("model"):
        return [("--model", MODEL)]
    estimator, chosen = ADVANTAGES.get(given.get("advantage", "gae"), ADVANTAGES["gae"]), []
    if given.get("env") in ENVIRONMENTS:  # (its response budget grows with --max-turns)
        turns = given.get("max_turns", Config.max_turns)
        chosen.append(("multi-turn demo", {**MULTI_TURN_DEMO, "response_length": 12 * turns - 8}))
    if not estimator.critic:
        chosen.append(("critic-free demo", CRITIC_FREE_DEMO))
    if estimator.groups:
        chosen.append(("grouped demo", GROUPS_DEMO))
    return chosen


def make_config(**given) -> Config:  # the presets for these flags, then the flags themselves
    values = {k: v for _, preset in presets(given) for k, v in preset.items()}
    return Config(**{**values, **given})


def native_bf16(device: torch.device) -> bool:  # bf16 matmuls in hardware: CUDA sm >= 80; CPUs with AVX512-BF16/AMX
    if device.type == "cuda":  # the run's own device (not emulated bf16, which is_bf16_supported() counts)
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


Dist = collections.namedtuple("Dist", "rank local_rank world", defaults=(0, 0, 1))  # this process's place in the job


# ----------------------------------------------------------------------------------------------------------------
# THE ALGORITHM, in the order it runs; the PLUMBING after it is called by name. One iteration of train():
# make_batch (generate, the reward, choose_loss_tokens, score_frozen: reference log-probs) -> score_trainer (old
# log-probs, values, rewards, an ADVANTAGES estimator, the staleness weights) -> ppo_update (a POLICY_LOSSES loss,
# value_loss) -> WeightSync.publish (the sampler pulls the new weights before its next batch). The batch's record:


@dataclass
class Rollout:
    """One batch of B rows, a prompt and its completion each; the n rows of a prompt's group lie side by side
    (group_rows). Each stage fills its block: sampling, the frozen models' scoring, the trainer's scoring."""
    # sampling (generate, run_episodes, make_batch)
    prompt_ids: torch.Tensor  # (B, P) left-padded prompt tokens
    prompt_mask: torch.Tensor  # (B, P) 1 on real prompt tokens
    response: torch.Tensor  # (B, T) sampled tokens; pad after EOS
    response_mask: torch.Tensor  # (B, T) 1 on real response tokens, the EOS included
    behav_logprobs: torch.Tensor  # (B, T) log-prob of each token under the sampler, recorded at sampling time
    policy_version: torch.Tensor  # (B, T) int64: the policy version (PPO updates it contains) that sampled each token
    ended: torch.Tensor  # (B,) bool: the completion emitted a stop token (EOS) within --response-length
    kept_ids: torch.Tensor = None  # (B, T, K) ids top-k/top-p kept at each step, -1 padded; None without truncation
    # multi-turn (--env): the response columns hold every turn and, between them, the environment's observations,
    # which the models see but never sample, score or train on: response_mask covers the policy's tokens only
    context_mask: torch.Tensor = None  # (B, T) 1 on every real token, the observations' too; None: response_mask
    episodes: dict = None  # --env: each row's turn rewards and its environment's error (or None)
    prompts: list = None  # B prompt strings as the reward sees them
    completions: list = None  # B completion strings, decoded up to (not including) EOS
    gen_s: float = None  # seconds the sampling took
    sampler_rng: object = None  # the sampling generator's state after this batch, and the prompts drawn by then:
    prompts_drawn: int = None  # what a checkpoint at this batch resumes from
    # scoring, the frozen models (score_frozen)
    token_rewards: torch.Tensor = None  # (B, T) rewards placed on tokens: each turn's (--env) or a process reward's
    raw_scores: torch.Tensor = None  # (B,) sequence score of the reward model / function (token_rewards' sum)
    scores: torch.Tensor = None  # (B,) the same after the missing-EOS penalty
    loss_mask: torch.Tensor = None  # (B, T) the policy's tokens in the rows that enter the loss (choose_loss_tokens)
    forward_rows: torch.Tensor = None  # (B,) bool: the rows that need forwards after the reward (choose_loss_tokens)
    row_stats: dict = None  # what choose_loss_tokens and the sampler's filters left out, for the log
    ref_logprobs: torch.Tensor = None  # (B, T) under the frozen reference
    # scoring, the trainer (score_trainer)
    # (B, T) under the trainer's policy before the update: PPO's "old" policy, decoupled PPO's "proximal" one
    old_logprobs: torch.Tensor = None
    values: torch.Tensor = None  # (B, T) critic's value of the state before each token
    rewards: torch.Tensor = None  # (B, T) per-token reward: -kl_coef * kl_t, plus the score on the last real token
    advantages: torch.Tensor = None  # (B, T) from the --advantage estimator (ADVANTAGES)
    returns: torch.Tensor = None  # (B, T) the critic's targets (estimators with a critic only)
    is_weight: torch.Tensor = None  # (B, T) decoupled-PPO importance weight of each token (exactly 1 when fresh)
    correction: dict = None  # staleness / importance-weight statistics of this batch, for the log
    first_forward: tuple = None  # scoring's (logprobs, entropy) of the first minibatch, graph kept: its update

    def rows(self, index):  # the sub-batch of rows `index` (a LongTensor): the tensor fields, each row's
        return Rollout(**{f.name: getattr(self, f.name)[index] if f.type is torch.Tensor and getattr(self, f.name)
                          is not None else None for f in dataclasses.fields(self)})


def group_rows(items: list, n: int) -> list:  # THE group layout: each item n times side by side, rows g*n .. g*n+n-1
    return [x for x in items for _ in range(n)]


def by_group(x, n: int):  # (B, ...) -> (B / n, n, ...): a row per group (group_rows' layout)
    return x.view(-1, n, *x.shape[1:])


def flat_groups(scores, n: int):  # (B,) bool: the row's group of n completions all got the same score (no signal)
    groups = by_group(scores, n)
    return (groups == groups[:, :1]).all(1).repeat_interleave(n)


# ----------------------------------------------------------------------------------------------------------------
# the loop, and the producer's batches: sample, reward, choose the rows of the loss, reference log-probs


def train(cfg: Config, run, output_dir: str, threaded=None, ctx: Dist = Dist()):
    """threaded=None: a sampler thread iff --max-staleness > 0 (at staleness 0 it gives the inline loop's result to
    the bit). Version v = the weights after v updates: batch i is sampled with version >= i - max_staleness (Producer
    waits for it); the trainer scores and updates with version step - 1, then publishes version step. A --resume at
    staleness 0 ends at the uninterrupted run's weights."""
    t = start_training(cfg, run, output_dir, threaded, ctx)  # sampler copy, trained models, optimizers, a resume
    device = run.device
    with StopSignal() as stop, contextlib.closing(t):
        if run.task.evaluate is not None and not cfg.resume and ctx.rank == 0:  # the held-out scores before PPO
            scores = run.task.evaluate(t.evaluator, run.tokenizer, cfg)
            t.first_accuracy = scores["eval_accuracy"]
            t.logger.log({"step": 0, **scores, "time_s": 0.0})
            print(f"held-out sampled accuracy before PPO: {t.first_accuracy:.3f}" + "".join(
                f", {k[5:]} {v:.3f}" for k, v in scores.items() if k != "eval_accuracy"))
        t.producer = Producer(t)
        t.window_start = time.time()  # an iteration's window ends at the end of the next
        t.run_start = t.window_start - t.elapsed
        t.timer.take()
        for step in range(t.start + 1, cfg.steps + 1):
            # 1. the next batch: sampled by the sampler, scored by the reference and the reward (make_batch)
            batch = t.producer.get()
            # 2. scored with the current weights: old log-probs, values, rewards, advantages, staleness weights
            with t.timer.span("score: old log-probs, values", "trainer"):
                shuffle = [torch.randperm(len(batch.response), generator=t.shuffle_generator)
                           for _ in range(cfg.ppo_epochs)]  # each epoch's row order; the first one also scores
                kl = score_trainer(batch, t.actor, t.critic, cfg, shuffle[0], version=step - 1)
                for model in (t.actor, t.critic):
                    reshard(model)
                problem = nonfinite(batch)  # the non-finite guard, decided by all ranks together
                if any_rank(problem is not None, device) and torch.distributed.is_initialized():
                    problem = "; ".join(f"rank {r}: {p}" for r, p in enumerate(gather_objects(problem)) if p)
            # 3. the PPO update: --ppo-epochs x --minibatches clipped steps of the policy and the critic
            with t.timer.span("update", "trainer"):
                update_start = time.time()
                lr = t.schedules[0].get_last_lr()[0]  # the learning rate this update uses
                stats = ppo_update(t.actor, t.critic, *t.optimizers, batch, cfg, shuffle) if problem is None else {}
                problem = problem or stats.get("nonfinite")
                for schedule in t.schedules:
                    schedule.step()
                update_s = time.time() - update_start
            # 4. the new weights become version `step`; the sampler pulls them before its next batch (make_batch)
            with t.timer.span("publish weights", "trainer"):
                t.sync.publish(step)
                sync_ms = t.sync.sync_ms()
            # 5. log the iteration, evaluate, checkpoint; or skip the update (the weights stay finite) and count it
            if problem is None:
                log_iteration(t, step, batch, kl, stats, lr, update_s, sync_ms)
                if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps):
                    save_training(t, step, batch)
            else:
                t.bad_steps += 1
                t.logger.log({"step": step, "skipped_update": f"non-finite {problem}",
                              "time_s": time.time() - t.run_start})
                print(f"it {step:>4}/{cfg.steps} | update skipped: non-finite {problem} | "
                      f"{t.bad_steps}/{cfg.max_bad_steps} in a row", flush=True)
                if t.bad_steps >= cfg.max_bad_steps:
                    raise SystemExit(f"stopping: {t.bad_steps} consecutive updates skipped for non-finite values "
                                     f"(last: {problem}); the last good checkpoint is "
                                     f"{t.last_checkpoint or 'none (--save-every 0)'}")
            # 6. a SIGINT / SIGTERM to any rank: every rank stops after this iteration, with a checkpoint (after the
            # last one, the run ends as it would have: policy/ and the summary)
            if step < cfg.steps and any_rank(stop.name is not None, device):
                if not str(t.last_checkpoint).endswith(f"step-{step:08d}"):  # (not just written by --save-every)
                    save_training(t, step, batch)
                launcher = "python" if ctx.world == 1 else f"torchrun --nproc_per_node {ctx.world}"
                print(f"stopped by {stop.name or 'a signal to another rank'} after iteration {step}/{cfg.steps}; "
                      f"continue with: {launcher} ppo_tokens.py --resume {t.last_checkpoint}")
                return t.history
    finish_training(t)
    return t.history


def make_batch(t: "Training", i: int, stop: threading.Event) -> Rollout:
    """The producer's work for batch i, in the sampler thread when the loop overlaps."""
    cfg, run = t.cfg, t.run
    sample_round = functools.partial(sample_and_reward, t, i, t.sync.pull(), stop)  # one weight version, every round
    batch = sample_round()
    if cfg.dynamic_sampling:  # more rounds, until the batch holds groups with signal
        batch = dynamic_sampling(batch, sample_round, cfg, run.tokenizer.pad_token_id, t.sampler_group)
    with t.timer.span("score: reference", "sampler"):
        score_frozen(batch, run.reference, cfg, t.frozen_group)
        if run.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the batch is complete before the trainer's stream reads it
    return batch


def sample_and_reward(t: "Training", i: int, version: int, stop: threading.Event, round_: int = 0) -> Rollout:
    """A round of sampling: the next prompts, a group of completions each (this rank's rows), and their rewards."""
    cfg, run = t.cfg, t.run
    with t.timer.span("generate", "sampler"):
        t0 = time.perf_counter()
        prompts = [next(t.order) for _ in range(cfg.batch_size // cfg.samples_per_prompt)]
        t.prompts_drawn += len(prompts)
        rows = group_rows(prompts, cfg.samples_per_prompt)[t.rank_rows]  # every rank whole groups
        args = dict(sampling_args(cfg, run.tokenizer.pad_token_id, run.stop_ids, run.vocab),
                    generator=t.sample_generator, policy_version=version, stop=stop)
        texts = [run.prompt_texts[r] for r in rows]
        if run.env is None:
            ids, mask = left_pad([run.prompt_ids[r] for r in rows], run.tokenizer.pad_token_id, run.device)
            batch = generate(t.decoder, ids, mask, **args)
            batch.completions = decode_completions(run.tokenizer, batch)
        else:  # an environment per row, seeded by the run, the batch and the prompt: a resume replays it
            first = cfg.seed * 1_000_003 + (i + round_ * cfg.steps) * cfg.batch_size  # (round_: --dynamic-sampling's)
            seeds = [first + (t.rank_rows.start + k) // cfg.samples_per_prompt  # (a group's rows: one task)
                     for k in range(len(rows))]
            try:
                batch = run_episodes(t.decoder, [run.env() for _ in rows], texts, seeds, run.tokenizer, cfg, t.pool,
                                     functools.partial(static_decoder, t), **args)
                failed = [e for e in batch.episodes["errors"] if e]
                if failed:
                    print(f"--env: {len(failed)} of {len(rows)} episodes of batch {i} ended on an error; the first: "
                          f"{failed[0]}", flush=True)
                problem = None if 2 * len(failed) <= len(rows) else (
                    f"stopping: the environment failed in {len(failed)} of {len(rows)} episodes of batch {i} "
                    f"({failed[0]})")
            except SystemExit as e:  # reset() failed
                problem = str(e)
            problems = [p for p in gather_objects(problem, t.sampler_group) if p]  # every rank stops, or none
            if problems:
                raise SystemExit(f"{problems[0]}; the last good checkpoint is "
                                 f"{t.last_checkpoint or 'none (--save-every 0)'}")
        batch.prompts = texts
        batch.gen_s = time.perf_counter() - t0
        batch.sampler_rng = t.sample_generator.get_state()  # the state after this batch, for a checkpoint
        batch.prompts_drawn = t.prompts_drawn
    with t.timer.span("score: reward", "sampler"):
        reward_scores(batch, run.reward_fn, cfg)
    return batch


def dynamic_sampling(batch: Rollout, sample_round, cfg: Config, pad_id: int, group=None) -> Rollout:
    """DAPO's dynamic sampling (Yu et al. 2025): a batch holds only groups with signal (scores not all equal), and more
    rounds (sample_round(round_=k): the next prompts, sampled and rewarded) refill it, at most --dynamic-sampling;
    flat groups fill what is still missing (a group estimator's loss drops them). The groups are chosen over every
    rank's, in one order (round, rank, group), and each rank then takes its slice, as verl's single controller chooses:
    which groups a batch holds does not depend on the world size. group: the producer's process group."""
    n, wanted = cfg.samples_per_prompt, cfg.batch_size // cfg.samples_per_prompt  # groups in a batch, all ranks'
    rounds, signal = [batch], []  # this rank's rounds; each round's signal flags of every rank's groups, in order
    while True:
        signal.append(torch.cat(gather_objects((~flat_groups(rounds[-1].scores, n)[::n]).cpu(), group)))
        if sum(int(flags.sum()) for flags in signal) >= wanted or len(rounds) > cfg.dynamic_sampling:
            break
        rounds.append(sample_round(round_=len(rounds)))
    per_rank = len(batch.ended) // n  # groups a round on a rank
    world = len(signal[0]) // per_rank
    order = [(k, int(g)) for want in (True, False) for k, flags in enumerate(signal)
             for g in (flags == want).nonzero()[:, 0]][:wanted]  # signal first, then flat ones: (round, group)
    rank = torch.distributed.get_rank(group) if torch.distributed.is_initialized() else 0
    pool = concat_rollouts(rounds, pad_id)  # this rank's rows, round after round
    keys = sorted(order, key=lambda key: key[1] // per_rank)  # the chosen groups, by the rank that sampled them
    rows = [(k * per_rank + g % per_rank) * n + j for k, g in keys if g // per_rank == rank for j in range(n)]
    host = "cpu" if torch.distributed.is_initialized() else pool.response.device  # (gather_objects pickles)
    chosen = concat_rollouts(gather_objects(take_rows(pool, rows, host), group), pad_id)  # every rank's, in keys' order
    share = order[rank * wanted // world:(rank + 1) * wanted // world]  # this rank's slice, in the global order
    out = take_rows(chosen, [keys.index(key) * n + j for key in share for j in range(n)], batch.response.device)
    last = rounds[-1]  # this rank's sampler state and prompts drawn after the last round: a checkpoint's
    out.gen_s, out.sampler_rng, out.prompts_drawn = sum(r.gen_s for r in rounds), last.sampler_rng, last.prompts_drawn
    sampled = sum(len(flags) for flags in signal)
    out.row_stats = {"sampling_rounds": len(rounds), "filtered_frac": 1 - sum(int(f.sum()) for f in signal) / sampled}
    return out


# ----------------------------------------------------------------------------------------------------------------
# rollout: the policy samples a completion per prompt with its own KV-cache loop


def positions(mask):  # (B, L) -> (B, L): position ids that count real tokens only, right under left padding
    return (mask.cumsum(-1) - 1).clamp(min=0)


def truncate_logits(scaled_logits, top_k: int, top_p: float):
    """(B, V) -> (filtered logits, kept ids (B, K), -1 where dropped): the trainer renormalises over the same set.
    Top-p sees the top --top-k ids only (64 when --top-k is 0), so that the set has a fixed width."""
    values, ids = scaled_logits.topk(min(top_k or 64, scaled_logits.shape[-1]), dim=-1)  # (B, K) sorted, largest first
    if top_p < 1.0:  # as HF: top-k first, then top-p over the renormalised top-k distribution
        probs = torch.softmax(values, -1) if top_k else torch.softmax(scaled_logits, -1).gather(-1, ids)  # (B, K)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the smallest prefix whose mass reaches top_p
        ids = ids.masked_fill(drop, -1)
    keep = ids >= 0  # dropped slots re-write the top token (always kept) with its own value
    filtered = torch.full_like(scaled_logits, float("-inf"))
    filtered.scatter_(-1, torch.where(keep, ids, ids[:, :1]), torch.where(keep, values, values[:, :1]))
    return filtered, ids


def sample_tokens(probs, generator):  # (B, V) -> (B,): one draw per row
    """torch.multinomial(probs, 1)'s own method, argmax(p / E) with E ~ Exp(1), so the same tokens, without
    multinomial's two host syncs per call: the decode step never waits."""
    return probs.div(torch.empty_like(probs).exponential_(generator=generator)).argmax(-1)


class PlainDecoder:
    """The reference decode loop, for every causal LM that setup() accepts: the model's own cache, a 2D mask."""

    def __init__(self, model):
        self.model = model
        self.cache_kwarg, self.keep = decoder_kwargs(model)

    def start(self, prompt_ids, prompt_mask, position_ids):  # (B, P) each -> (B, V) logits of the first response token
        self.mask = prompt_mask  # (B, L)
        self.position = position_ids[:, -1:]
        self.cache = {"use_cache": True, **self.keep}
        return self._forward(prompt_ids, position_ids)

    def step(self, token):  # token (B,) -> (B, V) logits of the next one
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], 1)
        self.position = self.position + 1
        return self._forward(token[:, None], self.position)

    def _forward(self, input_ids, position_ids):
        out = self.model(input_ids=input_ids, attention_mask=self.mask, position_ids=position_ids, **self.cache)
        self.cache[self.cache_kwarg] = out.cache if self.cache_kwarg == "cache" else out.past_key_values
        return out.logits[:, -1]


@torch.no_grad()
def generate(sampler, prompt_ids, prompt_mask, *, max_new_tokens, temperature, stop_ids, pad_id, generator,
             top_k=0, top_p=1.0, vocab=None, policy_version=0, stop=None, budgets=None):
    """Our own sampling loop, so that every detail is visible; each token's log-prob comes from the function the
    trainer scores with. vocab: sample ids < vocab only (never our added pad). policy_version: the weights' version,
    each token's tag. stop: a threading.Event, checked between steps. budgets: (B,) each row's most new tokens
    (multi-turn), else max_new_tokens for every row."""
    limit = max_new_tokens if budgets is None else budgets
    decoder = PlainDecoder(sampler) if isinstance(sampler, nn.Module) else sampler
    logits = decoder.start(prompt_ids, prompt_mask, positions(prompt_mask))[:, :vocab]  # (B, V)
    stop_ids = torch.as_tensor(stop_ids, device=prompt_ids.device).reshape(-1)
    done = torch.zeros(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)
    tokens, masks, logprobs, kept = [], [], [], []
    for t in range(max_new_tokens):
        scaled = logits.float() / temperature  # (B, V)
        kept_ids = None
        if top_k > 0 or top_p < 1.0:
            scaled, kept_ids = truncate_logits(scaled, top_k, top_p)
            kept.append(kept_ids)
        token = sample_tokens(torch.softmax(scaled, -1), generator)  # (B,)
        logprob, _ = token_logprobs(logits, token, temperature, kept_ids=kept_ids)  # (B,)
        alive = ~done & (t < limit)
        tokens.append(torch.where(alive, token, pad_id))
        masks.append(alive)
        logprobs.append(torch.where(alive, logprob, 0.0))
        done = done | (alive & torch.isin(token, stop_ids))
        if t == max_new_tokens - 1 or (t % 4 == 3 and bool((done | (t + 1 >= limit)).all())):  # a sync every 4 steps
            break
        if stop is not None and stop.is_set():
            raise InterruptedError("the run is stopping")
        logits = decoder.step(tokens[-1])[:, :vocab]
    response = torch.stack(tokens, 1)  # (B, T)
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response=response,
                   response_mask=torch.stack(masks, 1).long(), behav_logprobs=torch.stack(logprobs, 1),
                   policy_version=torch.full_like(response, policy_version), ended=done,
                   kept_ids=torch.stack(kept, 1) if kept else None)


def completion_ids(batch: Rollout) -> list:  # each completion's real tokens less the stop token: what a reward reads
    lengths = (batch.response_mask.sum(-1) - batch.ended.long()).tolist()
    return [r[:n] for r, n in zip(batch.response.tolist(), lengths)]


def decode_completions(tokenizer, batch: Rollout):  # the text before EOS
    return tokenizer.batch_decode(completion_ids(batch), skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------------------------
# scoring: log-probs (the policy, the reference), values (the critic), on padded or packed rows


def sequence_logprobs(model, input_ids, attention_mask, position_ids, response, response_mask, temperature,
                      kept_ids=None, full_logits=False, layout=None, vocab=None):
    """THE token log-prob function: (log pi(response_t | context) under temperature, the entropy), each (B, T) fp32
    and 0 on pads; the hidden state at column P-1+t predicts token t. layout: one packed row (pack_sequences) whose
    positions layout["predict"] predict the real response tokens. vocab: ids < vocab only, as generate samples."""
    mask = response_mask.bool()
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    if layout is None:  # (B, T, H) hidden states
        predict = slice(input_ids.shape[1] - response.shape[1] - 1, -1)
        targets, target_mask, kept = response, mask, kept_ids
    else:  # (1, n, H): the n real response tokens only
        inputs["packed_layout"] = layout
        predict = layout["predict"]
        targets, target_mask = response[mask][None], None
        kept = None if kept_ids is None else kept_ids[mask][None]
    # fused when the logits are exactly hidden @ W.T (fused_head_agrees): never holds [tokens, vocab] logits; fp32 head
    head = getattr(model, "lm_head", None)
    if not full_logits and isinstance(head, nn.Linear) and head.bias is None:
        hidden = backbone_of(model)(**inputs).last_hidden_state[:, predict]
        out = outside_autocast(linear_token_logprobs, hidden, head.weight.dtype, head.weight[:vocab], targets,
                               temperature, mask=target_mask, kept_ids=kept)
    else:
        logits = model(**inputs).logits[:, predict, :vocab]
        out = token_logprobs(logits, targets, temperature, mask=target_mask, kept_ids=kept)
    if layout is not None:  # back to (B, T), zeros on the pads
        out = tuple(torch.zeros_like(mask, dtype=o.dtype).masked_scatter(mask, o[0]) for o in out)
    return out


class Actor(nn.Module):
    """sequence_logprobs as a module: DDP/FSDP2 sync/gather lm_head.weight, read by the fused path, only in forward."""

    def __init__(self, policy, temperature: float, full_logits=False, vocab=None):
        super().__init__()
        self.policy, self.temperature, self.full_logits, self.vocab = policy, temperature, full_logits, vocab

    def forward(self, input_ids, attention_mask, position_ids, response, response_mask, kept_ids=None, layout=None):
        return sequence_logprobs(self.policy, input_ids, attention_mask, position_ids, response, response_mask,
                                 self.temperature, kept_ids, self.full_logits, layout, self.vocab)


def full_sequence(batch: Rollout):  # prompt + response as one left-padded sequence, its mask and position ids
    seen = batch.response_mask if batch.context_mask is None else batch.context_mask  # observations: seen, not trained
    attention_mask = torch.cat([batch.prompt_mask, seen], 1)  # (B, P+T)
    # id 0 on the pads: our pad id lies outside the embedding of a reward model (and its critic) with our vocabulary
    input_ids = torch.cat([batch.prompt_ids, batch.response], 1).masked_fill(attention_mask == 0, 0)  # (B, P+T)
    return input_ids, attention_mask, positions(attention_mask)


def model_inputs(batch: Rollout, cfg: Config):  # (input_ids, attention_mask, position_ids, packed layout or None)
    return packed_inputs(batch) if cfg.micro_batch_tokens else (*full_sequence(batch), None)


def packed_inputs(batch: Rollout):  # the batch's real tokens as one row (kernels.py)
    input_ids, attention_mask, _ = full_sequence(batch)
    return pack_sequences(input_ids, attention_mask, batch.prompt_mask.sum(1), batch.response_mask)


def rollout_logprobs(model, batch: Rollout, cfg: Config, inputs=None):  # (logprobs, entropy), (B, T) each
    is_actor = isinstance(getattr(model, "module", model), Actor)  # (DDP's module)
    actor = model if is_actor else Actor(model, cfg.temperature, cfg.full_logits)
    *inputs, layout = inputs or model_inputs(batch, cfg)  # inputs: model_inputs(batch, cfg), when the caller has them
    return actor(*inputs, batch.response, batch.response_mask, batch.kept_ids, layout)


def critic_values(critic, batch: Rollout, inputs=None):  # (B, T): V(state before response token t), column P-1+t
    mask = batch.response_mask.bool()
    *inputs, layout = inputs or (*full_sequence(batch), None)  # inputs: model_inputs(batch, cfg); None = padded
    if layout is not None:
        values = critic(*inputs, packed_layout=layout)[0, layout["predict"]]  # (n,)
        return torch.zeros_like(mask, dtype=values.dtype).masked_scatter(mask, values)
    values = critic(*inputs)[:, batch.prompt_ids.shape[1] - 1:-1]
    return torch.where(mask, values, 0.0)


def reward_scores(batch: Rollout, reward_fn, cfg: Config):  # the reward: a model's, a function's, an environment's
    batch.raw_scores = reward_fn(batch)  # (B,)
    batch.scores = batch.raw_scores - cfg.missing_eos_penalty * (~batch.ended).float()  # N+: penalise runs without EOS


@torch.no_grad()
def score_frozen(batch: Rollout, reference, cfg: Config, group=None):
    """Once the rewards are in: the rows of the loss (choose_loss_tokens), and the reference's log-probs of those
    that need forwards (the others keep the sampler's, finite). No trainer weights: the overlapped loop runs it in the
    producer. group: the producer's, where the reference is sharded (shards_frozen): each forward gathers its weights
    from every rank, so every rank forwards all its rows, in as many micro-batches."""
    choose_loss_tokens(batch, cfg)
    batch.ref_logprobs = batch.behav_logprobs.clone()  # (B, T)
    scored = batch.forward_rows if group is None else torch.ones_like(batch.forward_rows)
    minibatches = scored.nonzero()[:, 0].split(len(scored) // cfg.minibatches)  # (as the update's, in size)
    minibatches = [m for m in minibatches if len(m)]
    for rows in itertools.chain(*micro_batch_rows(batch, minibatches, cfg, ranks_agree=group is not None, group=group)):
        with autocast(cfg, batch.response.device):  # as the trainer's forwards (--lora-rank: a bf16 base, fp32 head)
            batch.ref_logprobs[rows] = rollout_logprobs(reference, batch.rows(rows), cfg)[0]
    reshard(reference)


def choose_loss_tokens(batch: Rollout, cfg: Config):
    """THE one place that decides which rows and tokens enter the loss, once the scores are in: every forward, the
    denominators, the update and the logged statistics read what it sets.
      loss_mask (B, T): the policy's tokens, less the flat groups' (--drop-flat-groups: all scored the same, so their
        group advantages are 0 and they would only dilute the token mean; DAPO. With a KL in the reward they differ
        by the KL alone, which GRPO's group std would scale up to full-size advantages: they leave all the same);
      forward_rows (B,): the rows that need forwards: all of them with a critic (GAE needs every row's values), a KL
        in the reward (it enters the baselines) or torchrun micro-batches (counts must agree); else the loss's."""
    n = cfg.samples_per_prompt
    flat = flat_groups(batch.scores, n) if n > 1 else torch.zeros_like(batch.ended)  # (B,) groups without signal
    # (only a group estimator's: with a critic or the batch as the baseline a flat group still has advantages)
    kept = ~flat if cfg.drop_flat_groups and ADVANTAGES[cfg.advantage].groups else torch.ones_like(flat)
    batch.loss_mask = batch.response_mask * kept[:, None]  # (B, T)
    lockstep = torch.distributed.is_initialized() and (cfg.micro_batch_size or cfg.micro_batch_tokens)
    every_row = ADVANTAGES[cfg.advantage].critic or cfg.kl_in == "reward" or lockstep
    batch.forward_rows = kept | every_row
    batch.row_stats = {**(batch.row_stats or {}), **({"zero_std_groups": int(flat.sum()) // n} if n > 1 else {})}


# ----------------------------------------------------------------------------------------------------------------
# advantages: the KL in the reward, GAE, whitening, the estimators, the decoupled-PPO weights


def masked_mean(x, mask, denom=None):  # mean of x over mask == 1 (or sum / denom); NaN-safe outside the mask
    return torch.where(mask.bool(), x, 0.0).sum() / (mask.sum().clamp(min=1) if denom is None else denom)


def masked_moments(x, mask):  # (mean, unbiased variance) of x over mask == 1, over every rank's elements
    mask = mask.bool()
    total = all_reduce(torch.stack([torch.where(mask, x, 0.0).sum(), mask.sum().to(x.dtype)]))  # (sum, count)
    mean, n = total[0] / total[1], total[1]
    return mean, all_reduce(torch.where(mask, (x - mean) ** 2, 0.0).sum()) / (n - 1).clamp(min=1)


def global_masked_means(pairs) -> list:  # [masked_mean(x, mask) for x, mask in pairs] over all ranks, one collective
    parts = [torch.stack([torch.where(m.bool(), x, 0.0).sum().double(), m.bool().sum().double()]) for x, m in pairs]
    totals = all_reduce(torch.stack(parts))  # (n, 2): sums and counts
    return (totals[:, 0] / totals[:, 1].clamp(min=1)).tolist()


def masked_whiten(x, mask):  # (x - mean) / std over the real tokens (unbiased, as TRL; all ranks'); pads stay 0
    mean, var = masked_moments(x, mask)
    return torch.where(mask.bool(), (x - mean) * torch.rsqrt(var + 1e-8), 0.0)


def kl_estimate(logprobs, ref_logprobs, estimator: str):
    """Per-token estimators of KL(pi || ref) from samples of pi (Schulman, "Approximating KL Divergence", 2020), with
    log r = ref_logprob - logprob:  k1 = -log r (unbiased, can be negative),  k3 = (r - 1) - log r (unbiased, >= 0),
    k2 = (log r)^2 / 2 (biased, >= 0). As a loss term (--kl-in loss), on samples of pi: E[grad k2] = grad KL(pi || ref),
    E[grad k3] = grad KL(ref || pi) (GRPO's choice), E[grad k1] = 0."""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    return torch.expm1(log_ratio) - log_ratio  # k3 (check_config allows only these three)


def per_token_rewards(scores, kl, response_mask, kl_coef, token_rewards=None):
    """r_t = -kl_coef * kl_t on every real token, plus the sequence score on the last real token (the mask covers
    exactly the sampled tokens up to and including EOS, so never a pad). token_rewards (B, T): rewards that fall on
    their own tokens (each turn's on its last token, a process reward's), the score's rest (the missing-EOS
    penalty) on the last one."""
    rewards = torch.where(response_mask.bool(), -kl_coef * kl, 0.0)  # (B, T)
    last = (response_mask * torch.arange(1, response_mask.shape[1] + 1, device=kl.device)).argmax(-1, keepdim=True)
    if token_rewards is not None:
        rewards, scores = rewards + token_rewards, scores - token_rewards.sum(-1)
    return rewards.scatter_add(1, last, scores[:, None].to(rewards.dtype))


def gae(rewards, values, response_mask, gamma: float, lam: float):
    """Generalised advantage estimation (Schulman et al., 2016) over the real tokens of each response:
        delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},   returns_t = A_t + V_t,
    with V and A zero after the last real token (the episode ends there). Returns (advantages, returns), (B, T).
    Multi-turn (--env): t + 1 is the policy's next token, over an observation too. An observation is state, not a
    step: the value after a turn's last token is that before the next turn's first one, whose state has seen it."""
    order = torch.sort((response_mask == 0).to(torch.uint8), dim=1, stable=True).indices  # the policy's tokens first
    rewards, values, mask = (x.gather(1, order) for x in (rewards, values, response_mask.bool()))  # (one turn: as is)
    T = rewards.shape[1]
    rewards = torch.where(mask, rewards, 0.0)
    values = torch.cat([torch.where(mask, values, 0.0), torch.zeros_like(values[:, :1])], 1)  # (B, T+1): V_T = 0
    advantages, last_gae = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * values[:, t + 1] - values[:, t]
        advantages[:, t] = last_gae = torch.where(mask[:, t], delta + gamma * lam * last_gae, 0.0)
    returns = torch.where(mask, advantages + values[:, :T], 0.0)
    return tuple(torch.zeros_like(x).scatter(1, order, x) for x in (advantages, returns))  # back to their columns


# The advantage estimators: fn(batch, cfg) -> (advantages (B, T), the critic's targets (B, T) or None). Each declares
# what it needs: a critic, groups of --samples-per-prompt completions (rows g*n .. g*n + n-1), where the KL goes.


def gae_advantages(batch: Rollout, cfg: Config):  # PPO: GAE over the critic's values, whitened over the real tokens
    advantages, returns = gae(batch.rewards, batch.values, batch.response_mask, cfg.gamma, cfg.lam)
    return masked_whiten(advantages, batch.response_mask), returns


def reinforce_pp_advantages(batch: Rollout, cfg: Config):
    """REINFORCE++ (Hu 2025): the return-to-go G_t = sum_{k >= t} gamma^(k-t) r_k (GAE with V = 0, lambda = 1), the KL
    in the rewards, whitened over the batch's real tokens: the batch is the baseline, so neither critic nor groups."""
    returns, _ = gae(batch.rewards, torch.zeros_like(batch.rewards), batch.response_mask, cfg.gamma, 1.0)
    return masked_whiten(returns, batch.response_mask), None


def grpo_advantages(batch: Rollout, cfg: Config, eps=1e-6):
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (s_i - mean_group s) / (std_group s + eps), unbiased std as TRL and
    verl; --scale-rewards batch: the std of the whole batch (all ranks'); none: no division (Dr. GRPO, Liu et al.
    2025: the std favours prompts that are almost always solved or failed)."""
    groups = by_group(batch.rewards.sum(-1), cfg.samples_per_prompt)  # (B / n, n): the score less the rewards' KL
    centred = groups - groups.mean(1, keepdim=True)
    if cfg.scale_rewards == "group":
        centred = centred / (groups.std(1, keepdim=True) + eps)
    elif cfg.scale_rewards == "batch":
        returns = groups.reshape(-1)
        centred = centred / (masked_moments(returns, torch.ones_like(returns))[1].sqrt() + eps)
    return torch.where(batch.response_mask.bool(), centred.reshape(-1)[:, None], 0.0), None  # on every token


def rloo_advantages(batch: Rollout, cfg: Config):
    """RLOO (Ahmadian et al. 2024): A_i = s_i - mean_{j != i} s_j = n / (n - 1) * (s_i - mean_group s)."""
    n = cfg.samples_per_prompt
    groups = by_group(batch.rewards.sum(-1), n)  # (B / n, n)
    centred = (groups - groups.mean(1, keepdim=True)) * (n / (n - 1))
    return torch.where(batch.response_mask.bool(), centred.reshape(-1)[:, None], 0.0), None


Estimator = collections.namedtuple("Estimator", "fn critic groups kl_in")
ADVANTAGES = {"gae": Estimator(gae_advantages, critic=True, groups=False, kl_in="reward"),
              "reinforce++": Estimator(reinforce_pp_advantages, critic=False, groups=False, kl_in="reward"),
              "grpo": Estimator(grpo_advantages, critic=False, groups=True, kl_in="loss"),
              "rloo": Estimator(rloo_advantages, critic=False, groups=True, kl_in="loss")}


@torch.no_grad()
def score_trainer(batch: Rollout, policy, critic, cfg: Config, row_order=None, version=None):
    """Scoring with the current weights: proximal ("old") log-probs and values in the first epoch's micro-batches
    (row_order), so that its ratio is bit-exactly 1; then rewards, ADVANTAGES and the staleness correction.
    The first minibatch's policy forward, when it is one micro-batch, keeps its graph for its update step (a forward
    fewer); the critic's does not, so that the two models' activations are never held together (the update reruns
    it after the policy's backward). version: the trainer's (None: all fresh). -> per-token KL."""
    batch.old_logprobs = batch.behav_logprobs.clone()  # (rows skipped keep the sampler's values; nothing reads them)
    batch.values = torch.zeros_like(batch.behav_logprobs, dtype=torch.float32)  # the critic's output is fp32
    row_order = torch.arange(len(batch.response)) if row_order is None else row_order
    micro = micro_batch_rows(batch, update_minibatches(batch, cfg, [row_order]), cfg, ranks_agree=True)
    for k, rows in enumerate(itertools.chain(*micro)):
        mb, keep = batch.rows(rows), k == 0 and len(micro[0]) == 1
        inputs = model_inputs(mb, cfg)  # packed once for both models
        with torch.set_grad_enabled(keep), autocast(cfg, batch.response.device):
            logprobs, entropy = rollout_logprobs(policy, mb, cfg, inputs)
        with torch.no_grad(), autocast(cfg, batch.response.device):
            values = None if critic is None else critic_values(critic, mb, inputs)
        if keep:
            batch.first_forward = (logprobs, entropy)
        batch.old_logprobs[rows] = logprobs.detach()
        if values is not None:
            batch.values[rows] = values.detach()
    kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, cfg.kl_estimator)
    kl = torch.where(batch.response_mask.bool(), kl, 0.0)  # (B, T)
    reward_kl_coef = cfg.kl_coef if cfg.kl_in == "reward" else 0.0  # (--kl-in loss: micro_step adds it)
    batch.rewards = per_token_rewards(batch.scores, kl, batch.response_mask, reward_kl_coef, batch.token_rewards)
    batch.advantages, batch.returns = ADVANTAGES[cfg.advantage].fn(batch, cfg)
    off_policy_correction(batch, cfg, version)
    return kl


def off_policy_correction(batch: Rollout, cfg: Config, version=None):
    """Tokens an older policy sampled get the decoupled-PPO importance weight (Hilton et al. 2022; AReaL):
        w_t = exp(prox_logp_t - behav_logp_t), truncated at --is-cap; exactly 1 for fresh tokens,
    so at --max-staleness 0 this is plain PPO to the bit. --mismatch-correction: fresh tokens too (Yao et al. 2025):
    a sampler with other numerics (bf16, other kernels) is a slightly different policy even at the same version."""
    mask = batch.response_mask.bool()
    in_loss = batch.loss_mask.bool()  # what the statistics cover: a row without forwards has no prox log-probs
    age = torch.zeros_like(batch.policy_version) if version is None else version - batch.policy_version  # (B, T)
    fresh = (age == 0) & (not cfg.mismatch_correction)  # sampled with the trainer's weights
    log_ratio = batch.old_logprobs - batch.behav_logprobs  # log pi_prox / pi_behav
    weight = torch.where(fresh, 1.0, torch.exp(log_ratio))
    capped = mask & (weight > cfg.is_cap)
    batch.is_weight = torch.where(capped, cfg.is_cap, weight)
    # the sampler / trainer mismatch: |log pi_prox - log pi_behav|, and KL(behav || prox) (k3)
    mismatch_kl = kl_estimate(batch.behav_logprobs, batch.old_logprobs, "k3")
    means = global_masked_means([(age.float(), mask), (batch.is_weight, in_loss), (capped.float(), in_loss),
                                 (log_ratio.abs(), in_loss), (mismatch_kl, in_loss)])
    batch.correction = {"staleness_mean": means[0],
                        "staleness_max": int(torch.where(mask, age, 0).max()),
                        "is_weight_mean": means[1],
                        "is_weight_max": float(torch.where(in_loss, weight, 0.0).max()),
                        "is_capped_frac": means[2],
                        "behav_prox_max_diff": float(torch.where(in_loss, log_ratio, 0.0).abs().max()),
                        "behav_prox_mean_diff": means[3],
                        "behav_prox_kl": means[4],
                        "tokens_dropped": int((mask & ~batch.loss_mask.bool()).sum())}


# ----------------------------------------------------------------------------------------------------------------
# the losses. A policy loss is fn(logprobs, mb, cfg) -> (per-token loss (b, T), per-token statistics); policy_objective
# applies what every loss shares: the staleness weight, the loss mask, the aggregation.


def clipped_surrogate(ratio, advantages, cfg: Config):
    """PPO's clipped surrogate (Schulman et al., 2017): L_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps_high)),
    eps_high = --clip-range-high or eps (DAPO's clip-higher, Yu et al. 2025: unlikely tokens may grow more)."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_range, 1.0 + (cfg.clip_range_high or cfg.clip_range))
    return torch.maximum(unclipped, clipped), {"clipfrac": clipped > unclipped}


def ppo_loss(logprobs, mb: Rollout, cfg: Config):  # the ratio of each token: r_t = exp(logp_t - old_logp_t)
    return clipped_surrogate(torch.exp(logprobs - mb.old_logprobs), mb.advantages, cfg)


def gspo_loss(logprobs, mb: Rollout, cfg: Config):
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its loss tokens' ratios,
    s = exp(mean_t (logp_t - old_logp_t)), clipped as PPO's (GSPO's clip ranges are small, e.g. 3e-4 and 4e-4). In
    its token form s_t = sg(s) * pi_t / sg(pi_t): the value is s, each token's gradient s * grad logp_t."""
    mask = mb.loss_mask.bool()
    log_ratio = torch.where(mask, logprobs - mb.old_logprobs, 0.0)
    sequence = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (b, 1)
    return clipped_surrogate(torch.exp(sequence.detach() + logprobs - logprobs.detach()), mb.advantages, cfg)


def cispo_loss(logprobs, mb: Rollout, cfg: Config):
    """CISPO (MiniMax-M1, 2025): L_t = -sg(clip(r_t, 1 - eps, 1 + eps_high)) * A_t * logp_t, the clipped importance
    weight gradient-stopped: unlike PPO's clip, no token loses its gradient."""
    ratio = torch.exp(logprobs - mb.old_logprobs)
    weight = torch.clamp(ratio, 1.0 - cfg.clip_range, 1.0 + (cfg.clip_range_high or cfg.clip_range)).detach()
    return -weight * mb.advantages * logprobs, {"clipfrac": weight != ratio}


# Each loss declares its paper's aggregation (--loss-agg auto), as an estimator declares where its KL goes
PolicyLoss = collections.namedtuple("PolicyLoss", "fn loss_agg")
POLICY_LOSSES = {"ppo": PolicyLoss(ppo_loss, "token-mean"),
                 "gspo": PolicyLoss(gspo_loss, "seq-mean-token-mean"),  # the GSPO paper's, and verl's
                 "cispo": PolicyLoss(cispo_loss, "token-mean")}

# A micro-batch's part of its minibatch's loss (loss_denominators): the logged means' and --loss-agg's denominators,
# each row's token weight (b, 1) or None. The default: token means over the micro-batch itself.
Share = collections.namedtuple("Share", "tokens denom token_weight", defaults=(None, None, None))


def aggregate(x, mask, share: Share = Share()):  # the sum of x over mask, weighted and divided as --loss-agg says
    return masked_mean(x if share.token_weight is None else x * share.token_weight, mask, share.denom)


def policy_objective(logprobs, mb: Rollout, cfg: Config, share: Share = Share()):
    """The --policy-loss's token losses times the decoupled-PPO weight, over the pg mask, aggregated. Statistics: the
    loss's token means, approx KL(old || new) = mean (r - 1) - log r (k3), max |r - 1|."""
    token_loss, token_stats = POLICY_LOSSES[cfg.policy_loss].fn(logprobs, mb, cfg)
    if mb.is_weight is not None:
        token_loss = token_loss * mb.is_weight
    loss = aggregate(token_loss, mb.loss_mask, share)
    with torch.no_grad():
        log_ratio = logprobs - mb.old_logprobs
        stats = {k: masked_mean(v.to(logprobs.dtype), mb.loss_mask, share.tokens) for k, v in token_stats.items()}
        stats["approx_kl"] = masked_mean(kl_estimate(mb.old_logprobs, logprobs, "k3"), mb.loss_mask, share.tokens)
        stats["ratio_max_dev"] = torch.where(mb.loss_mask.bool(), (torch.exp(log_ratio) - 1).abs(), 0.0).max()
    return loss, stats


def value_loss(values, old_values, returns, mask, clip_range, share: Share = Share()):
    """Clipped value loss (OpenAI baselines, N+): V moves at most clip_range from the rollout's; the worse error counts:
        L = 0.5 * mean_t max((V_t - R_t)^2, (old_V_t + clip(V_t - old_V_t, -c, c) - R_t)^2), the mean as --loss-agg."""
    clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    unclipped_error, clipped_error = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(unclipped_error, clipped_error), mask, share)
    clipped_worse = (unclipped_error < clipped_error).to(values.dtype)  # (a comparison: no gradient to keep)
    return loss, {"vf_clipfrac": masked_mean(clipped_worse, mask, share.tokens)}


def explained_variance(values, returns, mask):  # 1 - Var[R - V] / Var[R]: 1 = the critic predicts R, 0 = their mean
    mask = mask.bool()
    r, v = returns[mask], values[mask]
    return 1.0 - (r - v).var() / r.var().clamp(min=1e-8)


# ----------------------------------------------------------------------------------------------------------------
# update


@contextlib.contextmanager
def gradient_sync(models, enabled: bool):
    """DDP: all-reduce gradients in this backward only when enabled (the minibatch's last). FSDP2 reduce-scatters in
    every backward, so that gradients accumulate as shards: without, each rank would hold them whole until then."""
    with contextlib.ExitStack() as stack:
        for model in models:
            if hasattr(model, "no_sync") and not enabled:  # DDP
                stack.enter_context(model.no_sync())
        yield


def ppo_update(policy, critic, policy_opt, critic_opt, batch: Rollout, cfg: Config, row_orders):
    """ppo_epochs x minibatches optimizer steps; row_orders[e] is epoch e's row order (epoch 0's: scoring's). A
    NaN/inf loss or grad norm skips that step and the rest (earlier steps stand): returns {"nonfinite": where}."""
    sums = {}  # each logged statistic, summed over the optimizer steps
    n_steps = 0
    first_ratio_max_dev = torch.zeros(())
    models = [m for m in (policy, critic) if m is not None]
    optimizers = [o for o in (policy_opt, critic_opt) if o is not None]
    minibatches = update_minibatches(batch, cfg, row_orders[:cfg.ppo_epochs])  # epoch by epoch
    tokens, denominators, row_weight, empty = loss_denominators(batch, minibatches, cfg)
    for i, micro_rows in enumerate(micro_batch_rows(batch, minibatches, cfg, ranks_agree=True)):
        epoch, minibatch = divmod(i, cfg.minibatches)
        for j, rows in enumerate(micro_rows):
            with gradient_sync(models, enabled=j == len(micro_rows) - 1):
                token_weight = None if row_weight is None else row_weight[rows][:, None]  # (b, 1)
                share = Share(tokens[i], denominators[i], token_weight)
                first, batch.first_forward = (batch.first_forward, None) if i == j == 0 else (None, None)
                step_stats = micro_step(policy, critic, batch.rows(rows), cfg, share, first)
            ratio_max_dev = step_stats.pop("ratio_max_dev")
            if n_steps == 0:  # the first minibatch: the weights are the ones scoring used, so this is 0 (see below)
                first_ratio_max_dev = torch.maximum(first_ratio_max_dev, ratio_max_dev)
            for k, v in step_stats.items():  # micro-batch shares add up to minibatch means; .item() only at the end
                sums[k] = sums.get(k, 0.0) + v.detach()
        if empty[i]:  # not a loss token on any rank (all dropped): no optimizer step, as if it were not there
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            continue
        norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), cfg.max_grad_norm or math.inf) for m in models]
        # FSDP2 returns a DTensor (--offload: on the host)
        norms = [getattr(n, "full_tensor", lambda: n)().to(sums["pg_loss"].device) for n in norms]
        losses = [sums["pg_loss"]] + ([sums["vf_loss"]] if critic is not None else [])
        finite = torch.isfinite(torch.stack([*losses, *norms])).tolist()  # one sync
        if any_rank(not all(finite), norms[0].device):  # the non-finite guard, decided by all ranks together
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            names = ["policy loss", "value loss"][:len(models)] + ["policy grad norm", "critic grad norm"][:len(models)]
            problem = ", ".join([n for n, ok in zip(names, finite) if not ok] or ["loss on another rank"])
            return {"nonfinite": f"{problem} at epoch {epoch + 1} minibatch {minibatch + 1} (after {n_steps} finite "
                                 "steps)"}
        for name, norm in zip(("grad_norm", "critic_grad_norm"), norms):
            sums[name] = sums.get(name, 0.0) + norm
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        n_steps += 1
    means = {k: float(v) / max(1, n_steps) for k, v in sums.items()}
    return {**means, "first_ratio_max_dev": float(first_ratio_max_dev)}


def update_minibatches(batch: Rollout, cfg: Config, row_orders):
    """Each optimizer step's rows, less those without forwards (choose_loss_tokens; one stays: lockstep)."""
    minibatch_size = batch.response.shape[0] // cfg.minibatches
    minibatches = [rows for order in row_orders for rows in order.to(batch.response.device).split(minibatch_size)]
    if batch.forward_rows.all():
        return minibatches
    kept = [rows[batch.forward_rows[rows]] for rows in minibatches]  # (the boolean index is each minibatch's one sync)
    return [k if len(k) else rows[:1] for k, rows in zip(kept, minibatches)]


def micro_step(policy, critic, mb: Rollout, cfg: Config, share: Share, first=None) -> dict:
    """One micro-batch's forward and backward: policy_objective - entropy bonus (+ kl_coef * KL), and value_loss.
    first: scoring's (logprobs, entropy) of these rows, with their graph: that forward is not rerun."""
    logprobs, entropy = first or (None, None)
    inputs = None if first and critic is None else model_inputs(mb, cfg)  # packed once for both models
    if logprobs is None:
        with autocast(cfg, mb.response.device):
            logprobs, entropy = rollout_logprobs(policy, mb, cfg, inputs)
    pg_loss, pg_stats = policy_objective(logprobs, mb, cfg, share)
    stats = {"pg_loss": pg_loss, "entropy": masked_mean(entropy, mb.loss_mask, share.tokens), **pg_stats}
    objective = pg_loss - cfg.entropy_coef * aggregate(entropy, mb.loss_mask, share)
    if cfg.kl_in == "loss":  # GRPO's KL term
        # clamped at 10 as verl's low_var_kl: k3's exp overflows where the policy left the reference far behind
        stats["kl_loss"] = aggregate(kl_estimate(logprobs, mb.ref_logprobs, cfg.kl_estimator).clamp(max=10),
                                     mb.loss_mask, share)
        objective = objective + cfg.kl_coef * stats["kl_loss"]
    objective.backward()
    if critic is not None:  # after the policy's backward freed its activations
        with autocast(cfg, mb.response.device):
            values = critic_values(critic, mb, inputs)
        stats["vf_loss"], vf_stats = value_loss(values, mb.values, mb.returns, mb.loss_mask, cfg.value_clip_range,
                                                share)
        stats["vf_loss"].backward()
        stats.update(vf_stats)
    return stats


def loss_denominators(batch: Rollout, minibatches, cfg: Config):
    """Each minibatch's denominators over all ranks (/ world, as DDP averages gradients), so that its loss does not
    depend on the split into micro-batches and ranks. --loss-agg: token-mean: the tokens; seq-mean-token-mean: the
    sequences, each token weighted by 1 / its sequence's tokens; seq-mean-token-sum-norm (Dr. GRPO): sequences x
    --response-length. Returns (tokens (M,), denominators (M,), row weights (B,) or None, empty (M,))."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    lengths = batch.loss_mask.sum(1)  # (B,)
    counts = torch.stack([torch.stack([lengths[rows].sum(), (lengths[rows] > 0).sum()]) for rows in minibatches])
    counts = all_reduce(counts)  # (M, 2) over all ranks
    empty = (counts[:, 0] == 0).tolist()
    counts = counts.clamp(min=1) / world
    tokens, sequences = counts[:, 0], counts[:, 1]
    if cfg.loss_agg == "token-mean":
        return tokens, tokens, None, empty
    if cfg.loss_agg == "seq-mean-token-mean":
        return tokens, sequences, 1.0 / lengths.clamp(min=1), empty
    return tokens, sequences * cfg.response_length, None, empty


# ================================================================================================================
# PLUMBING: everything below is called by the algorithm above. First: set-up and models.
# ================================================================================================================


@dataclass
class Run:
    """What setup() builds for a run: the models, the tokenizer, the prompts, the reward, the task's hooks."""
    tokenizer: object
    policy: nn.Module  # the trained policy, fp32
    reference: nn.Module  # Actor over a frozen copy of the policy
    critic: nn.Module  # ScalarHeadModel, or None for an estimator without one
    reward_fn: object  # Rollout -> (B,) scores: reward_model_scores, rule_scores or --env's episode_return
    prompt_texts: list  # the training prompts, as the reward sees them
    prompt_ids: list  # and as token ids (format_prompts)
    stop_ids: list  # every id that ends a completion
    vocab: int  # the sampled ids: < vocab
    env: object  # --env's factory, or None
    task: "Task"  # the task's hooks: warm-up, held-out evaluation
    lora: object = None  # --lora-rank: the peft model over the policy (its adapters: policy_adapter/)
    reward_model: nn.Module = None  # --reward-model's (reward_fn scores with it)
    device: torch.device = None  # the run's: the sampler's, its batches' (--fsdp --offload: not the trained weights')


def setup(cfg: Config, ctx: Dist = Dist()) -> Run:
    """Tokenizer, policy (warmed up by the task), reference, critic, reward function, prompts; cheap checks first."""
    name = cfg.device if cfg.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(f"cuda:{ctx.local_rank}" if name == "cuda" else name)  # torchrun: one GPU per local rank
    if device.type == "cuda":  # the current device: Triton launches, streams, events and graphs use it
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32  # fp32 matmuls (trainer, fp32 heads) in TF32: README
    if cfg.offload and device.type != "cuda":
        raise SystemExit(f"--offload moves what waits on a GPU to the host; this run is on {device}: drop --offload")
    if cfg.bf16 and not native_bf16(device):  # (emulated bf16 is slower than fp32)
        raise SystemExit(f"--bf16: {device} has no bf16 matmuls (CUDA before sm 80, a CPU without AVX512-BF16 or AMX); "
                         "pass --no-bf16")
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed)
    task = load_task(cfg)  # what a flag does not give, the task does (the demo's: addition_task)
    prompt_texts = load_prompts(cfg.prompts) if cfg.prompts else task.prompts
    rule = load_function(cfg.reward) if cfg.reward else task.reward
    reward_shape = meta_model(cfg.reward_model, causal=False)
    if cfg.model:  # before loading any weights: a run that cannot fit stops here
        plan_memory(cfg, device, ctx.world, meta_model(cfg.model), reward_shape)
    tokenizer, policy, stop_ids, vocab = load_policy(cfg, device, task)
    if not cfg.model:  # (the task's model, built)
        plan_memory(cfg, device, ctx.world, policy, reward_shape, tokenizer)
    if not prompt_texts:
        raise SystemExit("no prompts: pass --prompts FILE.jsonl, or a --task that has them")
    prompt_ids = format_prompts(tokenizer, prompt_texts, cfg.chat_template, cfg.max_prompt_length)
    longest = max(map(len, prompt_ids))
    context = getattr(policy.config, "max_position_embeddings", None)
    if context and longest + cfg.response_length > context:
        raise SystemExit(f"the longest prompt ({longest} tokens) plus --response-length {cfg.response_length} exceeds "
                         f"the model's context of {context} tokens; lower --max-prompt-length or --response-length")
    reward_model, same_tokenizer, reward_fn = None, False, None
    if cfg.reward_model:
        reward_model, rm_tokenizer = load_reward_model(cfg.reward_model, device, dtype)
        same_tokenizer = same_vocabulary(rm_tokenizer, tokenizer)
        rows = cfg.micro_batch_size or cfg.batch_size // cfg.minibatches // ctx.world
        reward_fn = functools.partial(reward_model_scores, reward_model, rm_tokenizer, tokenizer,
                                      use_chat_template=cfg.chat_template, micro_batch_size=rows)
    elif cfg.env:  # the environment's rewards
        reward_fn = episode_return
    elif rule is not None:
        reward_fn = functools.partial(rule_scores, rule)
    elif not cfg.bench_rollout:  # (which samples only)
        raise SystemExit("no reward: pass --reward module:function, --reward-model DIR, --env, or a --task with one")
    if task.warmup is not None:  # e.g. supervised steps, so that PPO starts from a policy that is sometimes right
        if ctx.rank > 0:  # rank 0 warms up first (and may fill a cache); the other ranks then
            torch.distributed.barrier()
        task.warmup(policy, tokenizer, cfg)
        if ctx.rank == 0 and ctx.world > 1:
            torch.distributed.barrier()
    unpackable = ""  # why packed forwards cannot be used (use_packed_attention)
    if cfg.micro_batch_tokens:
        if cfg.micro_batch_tokens < longest + cfg.response_length:
            raise SystemExit(f"--micro-batch-tokens {cfg.micro_batch_tokens} is less than the longest sequence (a "
                             f"{longest}-token prompt + --response-length {cfg.response_length}); raise it")
        unpackable = use_packed_attention(backbone_of(policy), cfg.bf16)  # before the copies, which inherit it
    critic, critic_from, lora = None, f"no critic (--advantage {cfg.advantage})", None
    if cfg.lora_rank:  # one frozen base under three module trees, each of the trained two with its own adapters
        lora, reference, critic = lora_models(policy, cfg, trained_dtype(cfg))
        critic_from = "critic: adapters and a zero-initialised head over the policy's base" if critic else critic_from
    else:
        reference = offload_layers(cast_parameters(copy.deepcopy(policy), dtype).requires_grad_(False), cfg, device)
        if ADVANTAGES[cfg.advantage].critic:
            critic = build_critic(policy, reward_model, same_tokenizer)
            critic_from = f"critic from {'the reward model' if same_tokenizer else 'the policy, zero-initialised head'}"
            if cfg.micro_batch_tokens and not unpackable:  # (a critic from the reward model: its own attention)
                unpackable = use_packed_attention(critic.backbone, cfg.bf16)
    if reward_model is not None:  # (after the critic's copy of it)
        offload_layers(reward_model, cfg, device)
    if cfg.micro_batch_tokens and any_rank(bool(unpackable), device):  # all pack or none: DDP pairs micro-batches
        unpackable = unpackable or "another rank's model cannot run packed"
    if unpackable:  # padded micro-batches of as many rows as the token budget holds at the longest padded length
        fits = cfg.micro_batch_tokens // (longest + cfg.response_length)
        rows = max(r for r in range(1, fits + 1) if cfg.batch_size // cfg.minibatches // ctx.world % r == 0)
        fall_back(f"--micro-batch-tokens off: {unpackable}; padded micro-batches of {rows} rows instead "
                  f"(--micro-batch-size {rows})")
        cfg.micro_batch_tokens, cfg.micro_batch_size = 0, rows
    print(f"policy {sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M parameters on {device}; {critic_from}")
    return Run(tokenizer, policy, Actor(reference, cfg.temperature, cfg.full_logits, vocab), critic, reward_fn,
               prompt_texts, prompt_ids, stop_ids, vocab, load_env(cfg.env) if cfg.env else None, task, lora,
               reward_model, device)


def trained_dtype(cfg: Config):  # the policy's weights: fp32 (bf16 Adam steps round away); --lora-rank: the base's
    return getattr(torch, cfg.dtype) if cfg.lora_rank and cfg.bf16 else torch.float32


def load_policy(cfg: Config, device, task):  # -> (tokenizer, fp32 policy (bf16 Adam steps round away), stop ids, vocab)
    if cfg.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(cfg.model)
            policy = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=trained_dtype(cfg))
        except (OSError, ValueError) as e:
            raise SystemExit(f"--model {cfg.model}: cannot load a causal LM and its tokenizer "
                             f"({str(e).splitlines()[0]})")
    elif task.model is not None:
        tokenizer, policy = task.model(cfg)
    else:
        raise SystemExit("no model: pass --model (an HF causal LM), or a --task that builds one")
    if policy.config.model_type in ("rwkv", "xlstm", "recurrent_gemma", "mamba", "falcon_mamba"):
        raise SystemExit(f"--model {cfg.model}: {policy.config.model_type} is not supported: its recurrent state "
                         "ignores left padding or its 1-token decode steps (the sampler batches left-padded prompts)")
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"the tokenizer of {cfg.model or 'the task'} has no EOS token; set eos_token in its config")
    stop_ids = stop_token_ids(tokenizer, policy)
    vocab = ensure_pad_token(tokenizer, policy, stop_ids)
    disable_dropout(policy)
    # eval: no dropout; a task's model in fp32 for its warm-up (--lora-rank: lora_models casts the base after it)
    policy.to(device, trained_dtype(cfg) if cfg.model else torch.float32).eval()
    if not cfg.full_logits and not fused_head_agrees(policy, vocab):
        fall_back(f"{type(policy).__name__} post-processes its logits (they are not hidden @ lm_head.weight.T): "
                  "log-probs from its full logits (--full-logits)")
        cfg.full_logits = True
    return tokenizer, policy, stop_ids, vocab


def meta_model(path: str, causal=True):  # the model at `path` without its weights (the meta device), or None
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification
    try:
        config = AutoConfig.from_pretrained(path, **({} if causal else {"num_labels": 1})) if path else None
        with torch.device("meta"):
            return config and (AutoModelForCausalLM if causal else AutoModelForSequenceClassification).from_config(
                config)
    except Exception:  # (load_policy and load_reward_model say why, if it does not load)
        return None


def device_memory(device) -> int:  # bytes: the GPU's, or the host's RAM (within a container's limit: cgroup v2's)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            return min(ram, int(f.read()))
    except (OSError, ValueError):  # (no such file, or "max": no limit)
        return ram


def critic_copies_reward(cfg: Config, tokenizer=None) -> bool:  # build_critic's choice, made from the tokenizers
    if not (cfg.reward_model and ADVANTAGES[cfg.advantage].critic and not cfg.lora_rank):
        return False
    from transformers import AutoTokenizer
    try:
        return same_vocabulary(tokenizer or AutoTokenizer.from_pretrained(cfg.model),
                               AutoTokenizer.from_pretrained(cfg.reward_model))
    except (OSError, ValueError):  # (load_policy and load_reward_model say why)
        return False


def plan_memory(cfg: Config, device, world: int, policy, reward_model, tokenizer=None):
    """One line: the bytes each part of the run holds on this device before activations (README: Memory), against
    its memory; where they exceed it, a stop, before the big models load, that says what would fit. tokenizer: the
    policy's, where it is not at --model (whether the critic copies the reward model: critic_copies_reward)."""
    if policy is None:
        return
    copies_reward = reward_model is not None and critic_copies_reward(cfg, tokenizer)
    capacity, ram, gib = device_memory(device), device_memory(torch.device("cpu")), 2**30

    def show(where: str, parts: dict, capacity: int):  # one line: each part, their total, against the capacity
        total = sum(parts.values())
        unit, size = ("GiB", gib) if total >= gib else ("MiB", 2**20)
        shown = ", ".join(f"{k} {v / size:.2f}" for k, v in parts.items() if v)
        print(f"memory on {where}, {unit}: {shown} = {total / size:.2f} of {capacity / size:.0f}")
        return total
    models = (policy, reward_model, copies_reward)
    total = show(f"{device} before activations", memory_parts(cfg, device, world, *models), capacity)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun: the processes that share this host's memory
    host = lambda **flag: ranks * sum(host_parts(dataclasses.replace(cfg, **flag), device, world,  # noqa: E731
                                                 *models).values())
    if cfg.offload:  # what --offload moves into pinned host memory, beside the process's own
        pinned = ranks * show(f"the host (--offload){f', per rank ({ranks} on this host)' if ranks > 1 else ''}",
                              host_parts(cfg, device, world, *models), ram)
        if pinned > ram:
            lora = host(lora_rank=16)
            fits = [f"--lora-rank 16 (~{lora / gib:.0f} GiB)"] if not cfg.lora_rank and lora < ram else []
            fits += ["fewer ranks a host"] * (ranks > 1) + ["a smaller model"]
            raise SystemExit(f"--offload: this run needs ~{pinned / gib:.0f} GiB of host memory, more than its "
                             f"{ram / gib:.0f} GiB: try {' or '.join(fits)}")
    if total > capacity:  # what the run would need with another flag (the same parts)
        needs = lambda gpus=world, **flag: sum(memory_parts(dataclasses.replace(cfg, **flag), device,  # noqa: E731
                                                            gpus, *models).values())
        lora, offload = needs(lora_rank=16), needs(offload=True)
        fits = [f"--lora-rank 16 (~{lora / gib:.0f} GiB)"] if not cfg.lora_rank and lora < capacity else []
        fits += [f"--offload (~{offload / gib:.0f} GiB)"] if device.type == "cuda" and offload < capacity and \
            host(offload=True) <= ram else []  # (if the host holds what it moves)
        gpus = next((n for n in range(max(2, world + 1), 257) if needs(n, fsdp=True) <= capacity), None)
        if gpus:  # FSDP2 over the fewest GPUs that each hold what the memory line counts
            fits.append(f"sharding over {gpus} GPUs (torchrun --nproc_per_node {gpus} ... --fsdp)")
        raise SystemExit(f"this run needs ~{total / gib:.0f} GiB on {device} before activations, more than its "
                         f"{capacity / gib:.0f} GiB: try {' or '.join(fits + ['a smaller model'])}")


def memory_parts(cfg: Config, device, world: int, policy, reward_model, copies_reward=False) -> dict:  # {part: bytes}
    count = lambda modules: sum(p.numel() for m in modules if m is not None for p in m.parameters())  # noqa: E731
    n, shards, critic = count([policy]), world if cfg.fsdp else 1, ADVANTAGES[cfg.advantage].critic  # FSDP2: shards
    frozen = torch.finfo(getattr(torch, cfg.dtype)).bits // 8  # bytes a parameter of the frozen models
    base = torch.finfo(trained_dtype(cfg)).bits // 8  # (--lora-rank: the base's bytes a parameter; else fp32)
    one_copy = (2 if device.type == "cuda" else base) * n  # the sampler's weights (GPU: bf16)
    sampler = (1 + (cfg.max_staleness > 0)) * one_copy  # (+ WeightSync's staging)
    frozen /= shards if shards_frozen(cfg, device) and not cfg.offload else 1  # (FSDP2: the frozen models sharded)

    def in_use(model):  # --offload: the parameters outside its decoder layers, and one layer at a time
        layers = decoder_layers(model) if cfg.offload and model is not None else []
        return count([model]) - count(layers) + max((count([layer]) for layer in layers), default=0)
    wrapped = cfg.fsdp and (world > 1 or torch.distributed.is_initialized())  # (torchrun: FSDP2 wraps at world 1 too)
    reward, host = frozen * in_use(reward_model), cfg.offload and wrapped  # (host: the trained models' CPUOffload)
    if cfg.lora_rank:  # fp32 adapters (+ gradients, Adam: 16 bytes) of each adapted layer; one shared base
        n_lora = cfg.lora_rank * sum(m.in_features + m.out_features for m in lora_layers(cfg, policy))
        head = count([policy.get_output_embeddings()])  # fp32 (lora_models; tied: the embedding with it)
        trees = {"base": base * n + (4 - base) * head}
        if wrapped:  # FSDP2 gives each tree shards of its own (the critic's: the backbone, not the head)
            trees = {"policy base": trees["base"] / shards,
                     "critic base": base * count([backbone_of(policy)]) / shards * critic,
                     "reference": trees["base"] / (shards if shards_frozen(cfg, device) else 1)}
        if host:  # FSDP2's CPUOffloadPolicy: each tree's shards on the host, gathered a layer at a time
            trees = {"base, gathered": base * in_use(policy), "reference": 0 if shards_frozen(cfg, device) else
                     trees["reference"]}  # (a replicated reference tree: whole on the device)
        return {**trees, "policy adapters+grads+Adam": 16 * n_lora / shards,
                "critic adapters+grads+Adam": 16 * n_lora * critic / shards, "reward model": reward, "sampler": sampler}
    n_critic = count([reward_model if copies_reward else backbone_of(policy)]) * critic  # (build_critic's copy)
    adam = 0 if cfg.offload else 8  # (--offload: in for its step)
    trained = {"policy": 4 * n / shards, "policy grads+Adam": (4 + adam) * n / shards,  # fp32: 4 + 4 + 8 bytes
               "critic": 4 * n_critic / shards, "critic grads+Adam": (4 + adam) * n_critic / shards,
               "Adam at a step": (8 - adam) * max(n, n_critic) / shards}  # --offload: one model's moments at a time
    if host:  # FSDP2's CPUOffloadPolicy: all on the host; one model's root and layer gathered (weights, gradients)
        trained = {"trained, gathered": 8 * in_use(policy)}
    publish = one_copy if wrapped else 0  # (kernels.gather_shards' receive buffer)
    return {**trained, "reference": frozen * in_use(policy), "reward model": reward, "sampler": sampler,
            "publish's gather": publish}


def host_parts(cfg: Config, device, world: int, policy, reward_model, copies_reward=False) -> dict:  # {part: bytes}
    """What --offload moves to the host: the trained models' Adam moments and the frozen models' decoder layers, in
    pinned slabs (pinned_copies); under FSDP2's CPUOffloadPolicy their shards instead, each tensor's pinned alone (a
    power of two), of the trained models the fp32 weights and gradients (Adam's moments are not pinned there)."""
    if not cfg.offload:
        return {}
    shards, critic = world if cfg.fsdp else 1, ADVANTAGES[cfg.advantage].critic
    wrapped = cfg.fsdp and (world > 1 or torch.distributed.is_initialized())
    sharded = wrapped and shards_frozen(cfg, device)  # (the frozen models too)
    frozen, base = (torch.finfo(dtype).bits // 8 for dtype in (getattr(torch, cfg.dtype), trained_dtype(cfg)))
    numels = lambda model: [p.numel() for p in model.parameters()]  # noqa: E731
    head = [policy.config.hidden_size]  # (the critic's value head)
    if cfg.lora_rank:  # the adapters train: A (r, in) and B (out, r) of each adapted layer
        adapters = [n for m in lora_layers(cfg, policy) for n in (cfg.lora_rank * m.in_features,
                                                                   m.out_features * cfg.lora_rank)]
        trained = [adapters, adapters + head][:1 + critic]
    else:
        critic_sizes = numels(reward_model) if copies_reward else numels(backbone_of(policy)) + head
        trained = [numels(policy), critic_sizes][:1 + critic]
    if not wrapped:  # exp_avg and exp_avg_sq of each parameter, an optimizer's in its slabs
        parts = {"Adam moments": sum(pinned_slabs([4 * n for n in model for _ in "mv"])[0] for model in trained)}
    else:  # FSDP2: weights and gradients pinned, a shard each
        parts = {"trained weights+grads+Adam": sum(2 * power_of_two(4 * n / shards) + 8 * n / shards
                                                   for model in trained for n in model)}
        if cfg.lora_rank:  # each tree's shards of the base (the log-prob head in fp32: lora_models)
            fp32 = policy.get_output_embeddings().weight
            tree = [(4 if p is fp32 else base) * p.numel() for p in policy.parameters()]
            trees = tree * (1 + sharded) + [base * n for n in numels(backbone_of(policy))] * critic
            parts = {"base trees": sum(power_of_two(b / shards) for b in trees), **parts}

    def layers(model):  # a frozen model's decoder layers, in its slabs; or its shards, a tensor's pinned alone
        if model is None:
            return 0
        if sharded:
            return sum(power_of_two(frozen * n / shards) for n in numels(model))
        return pinned_slabs([frozen * p.numel() for layer in decoder_layers(model) for p in layer.parameters()])[0]
    return {**parts, "reference": 0 if cfg.lora_rank else layers(policy), "reward model": layers(reward_model)}


def lora_layers(cfg: Config, policy) -> list:  # --lora-rank: the linear layers of one model tree that get adapters
    names = None if cfg.lora_targets == "all-linear" else lora_targets(cfg)
    return [m for name, m in backbone_of(policy).named_modules() if isinstance(m, nn.Linear) and
            (names is None or lora_matches(name, names))]


PAD_TOKEN = "<|ppo_tokens_pad|>"


def same_vocabulary(a, b) -> bool:  # the pad token we may have added does not count (it is never a real token)
    return {**a.get_vocab(), PAD_TOKEN: None} == {**b.get_vocab(), PAD_TOKEN: None}


def stop_token_ids(tokenizer, model) -> list:
    """Every id that ends a completion: the tokenizer's EOS and the generation config's eos_token_id, where chat
    models name several (Llama 3's <|eot_id|> and <|eom_id|>, Gemma's <end_of_turn>, Qwen's <|im_end|>, ...)."""
    named = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return sorted({tokenizer.eos_token_id, *(named if isinstance(named, list) else [named])} - {None})


def ensure_pad_token(tokenizer, model, stop_ids=()) -> int:
    """A pad distinct from every stop id (a pad equal to EOS is how other code masks the real EOS out of the loss).
    Returns the sampled vocabulary: our added pad and the model's spare embedding rows lie above it."""
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id in (tokenizer.eos_token_id, *stop_ids):
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
        if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:  # many vocabularies have spare rows already
            model.resize_token_embeddings(len(tokenizer))
        model.config.pad_token_id = tokenizer.pad_token_id
    vocab = min(len(tokenizer), model.get_output_embeddings().weight.shape[0])
    return min(vocab, tokenizer.pad_token_id) if tokenizer.pad_token == PAD_TOKEN else vocab


def disable_dropout(model: nn.Module):  # N+ detail: with dropout the first minibatch's ratio would not be 1
    for m in [*model.modules(), getattr(model, "config", None)]:  # HF attention layers read float attributes
        for key, value in (vars(m).items() if m is not None else ()):
            if "dropout" in key and isinstance(value, float):
                setattr(m, key, 0.0)
        if isinstance(m, nn.Dropout):
            m.p = 0.0


def backbone_of(model):  # LlamaForCausalLM.model, Qwen2ForSequenceClassification.model, GPT2*.transformer, ...
    return getattr(model, model.base_model_prefix)


class ScalarHeadModel(nn.Module):  # the critic and the reward model: a causal-LM backbone, one scalar per token

    def __init__(self, backbone: nn.Module, head: nn.Linear):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, input_ids, attention_mask, position_ids, **packing):  # -> (B, L) float32
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False, **packing).last_hidden_state
        return outside_autocast(self.head, hidden, self.head.weight.dtype).squeeze(-1).float()  # --bf16: fp32 head


def load_reward_model(path: str, device, dtype):  # -> (ScalarHeadModel, its tokenizer)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    try:
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--reward-model {path}: cannot load a sequence-classification model and tokenizer "
                         f"({str(e).splitlines()[0]})")
    if model.config.num_labels != 1:
        raise SystemExit(f"--reward-model {path}: num_labels is {model.config.num_labels}; a reward model has 1")
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Linear):
        raise SystemExit(f"--reward-model {path}: no linear `score` head; use a causal-LM reward model "
                         "(LlamaForSequenceClassification, Qwen2ForSequenceClassification, ...)")
    rm = ScalarHeadModel(backbone_of(model), head)
    disable_dropout(rm)
    return rm.to(device).eval().requires_grad_(False), tokenizer


def build_critic(policy, reward_model=None, same_tokenizer=False):
    """A copy of the reward model when its tokenizer is the policy's (N+ detail: its head already predicts the score),
    else of the policy's backbone with a zero head: a random head's noise made the demo's accuracy collapse."""
    if reward_model is not None and same_tokenizer:
        return copy.deepcopy(reward_model).to(torch.float32).requires_grad_(True).eval()
    return ScalarHeadModel(copy.deepcopy(backbone_of(policy)), zero_head(policy)).to(torch.float32).requires_grad_(
        True).eval()


def zero_head(policy):  # the value head, fp32 and 0: V = 0 before the first update
    head = nn.Linear(policy.config.hidden_size, 1, bias=False, device=policy.device, dtype=torch.float32)
    nn.init.zeros_(head.weight)
    return head


# LoRA (--lora-rank, through peft): the reference is the base, so it costs nothing; the critic's base is the same
# tensors too (its own module tree, so no adapter is switched while another thread or a recomputation runs)


def lora_models(policy, cfg: Config, dtype):
    """The policy's weights become the frozen base (`dtype`); -> (the peft model over the policy, whose linear layers
    now carry trained fp32 adapters; the reference: the base's module tree without them; the critic or None)."""
    import peft
    cast_parameters(policy.requires_grad_(False), dtype)
    head = policy.get_output_embeddings().float()  # the log-prob head stays fp32, as in full fine-tuning (--bf16)
    embedding = policy.get_input_embeddings()  # where tied to the head, an adapter's merge on one changes the other
    for module, other in [(head, "input embedding"), (embedding, "output head")] * (head.weight is embedding.weight):
        name = next(n for n, m in policy.named_modules() if m is module)
        if cfg.lora_targets != "all-linear" and lora_matches(name, lora_targets(cfg)):  # (all-linear adapts neither)
            raise SystemExit(f"--lora-targets: {name} is this model's {other} too (tied weights): drop it")
    reference = shared_copy(policy)
    critic = None
    if ADVANTAGES[cfg.advantage].critic:  # its backbone over the same base tensors, adapters of its own
        critic = ScalarHeadModel(shared_copy(backbone_of(policy)), zero_head(policy)).eval()
    adapters = lambda: peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,  # noqa: E731
                                       target_modules=lora_targets(cfg))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)  # (peft asks transformers)
        try:
            lora = peft.get_peft_model(policy, adapters())  # in place: the policy's own layers get the adapters
            if critic is not None:
                peft.get_peft_model(critic.backbone, adapters())
        except ValueError as e:  # (no module matched --lora-targets)
            raise SystemExit(f"--lora-targets {cfg.lora_targets}: {str(e).splitlines()[0]}")
    adapted = [name for name, m in policy.named_modules() if hasattr(m, "lora_A")]
    missing = [t for t in lora_targets(cfg) if not any(lora_matches(n, [t]) for n in adapted)] \
        if cfg.lora_targets != "all-linear" else []  # (peft needs one name to match, not each)
    if missing:
        raise SystemExit(f"--lora-targets: no linear layer of the model is named {', '.join(missing)}")
    return lora, reference, critic


def lora_targets(cfg: Config):  # peft's target_modules: 'all-linear', or the names given
    return cfg.lora_targets if cfg.lora_targets == "all-linear" else [t.strip() for t in cfg.lora_targets.split(",")]


def lora_matches(name: str, targets) -> bool:  # peft's rule for a list of target_modules: the name, or a dotted suffix
    return any(name == t or name.endswith("." + t) for t in targets)


def shared_copy(model):  # the module tree again over the same parameters: no weight is copied
    return copy.deepcopy(model, memo={id(p): p for p in model.parameters()})


def merged_weights(policy):
    """--lora-rank: the base's weights in its own order (the sampler's), each adapted one + its adapter's s B A; whole
    (FSDP2: each gathered from the shards, a collective: every rank iterates it)."""
    for name, p in policy.named_parameters():
        if ".lora_" in name:  # (an adapter's own weights)
            continue
        if name.endswith(".base_layer.weight"):  # an adapted layer's
            layer = policy.get_submodule(name.removesuffix(".base_layer.weight"))
            p = p + layer.get_delta_weight(layer.active_adapters[0])
        yield getattr(p, "full_tensor", lambda: p)()


# --offload (CUDA): what waits on the GPU between its uses waits in pinned host memory, brought in non-blocking

def offload_layers(model, cfg: Config, device):
    """--offload: a frozen model's decoder layers in pinned host memory (sharded under --fsdp: FSDP2's
    CPUOffloadPolicy instead); each comes in for its forward and its device copy is dropped after, so the GPU holds
    one layer (and the embeddings, the head). The caching allocator frees in stream order: no sync is needed."""
    if not cfg.offload or (torch.distributed.is_initialized() and shards_frozen(cfg, device)):  # (start_training's)
        return model
    copies = iter(pinned_copies([p.data for layer in decoder_layers(model) for p in layer.parameters()]))
    for layer in decoder_layers(model):
        layer.host_weights = [next(copies) for _ in layer.parameters()]
        layer_to_host(layer)
        layer.register_forward_pre_hook(lambda layer, args: layer_to(layer, device))
        layer.register_forward_hook(lambda layer, args, output: layer_to_host(layer))
    return model


def layer_to(layer, device):  # --offload: the layer's weights onto the device, non-blocking from pinned memory
    for p, host in zip(layer.parameters(), layer.host_weights):
        p.data = host.to(device, non_blocking=True)


def layer_to_host(layer):  # and back: the device copies dropped
    for p, host in zip(layer.parameters(), layer.host_weights):
        p.data = host


def offload_moments(optimizer):
    """--offload: Adam's moments (8 bytes a trained parameter) in pinned host memory except during each step, as
    verl's optimizer offload: the trainer's forwards and backward have that memory (not the sampler, whose stream
    does not reuse the trainer's cached blocks); the step's peak holds them."""
    pinned = {}  # (parameter, moment) -> its pinned host buffer, reused at every step

    def move(to_host: bool):
        moments = [(p, k) for p, state in optimizer.state.items() for k, v in state.items()
                   if torch.is_tensor(v) and v.shape == p.shape]  # (exp_avg, exp_avg_sq; not step)
        new = [m for m in moments if to_host and m not in pinned]  # (the first step's: all at once)
        pinned.update(zip(new, pinned_copies([optimizer.state[p][k] for p, k in new])))
        for p, k in moments:  # (a copy to the host: checkpoint_state syncs before DCP reads or loads into it)
            state = optimizer.state[p]
            state[k] = pinned[p, k].copy_(state[k], non_blocking=True) if to_host else \
                state[k].to(p.device, non_blocking=True)
    optimizer.register_step_pre_hook(lambda *_: move(False))
    optimizer.register_step_post_hook(lambda *_: move(True))
    optimizer.register_load_state_dict_post_hook(lambda _: move(True))  # (a resume: loading casts them to the GPU)


def pinned_copies(tensors) -> list:  # pinned host copies of tensors, views into the slabs pinned_slabs lays out
    total, slab, places = pinned_slabs([t.numel() * t.element_size() for t in tensors])
    slabs = [torch.empty(slab, dtype=torch.uint8, pin_memory=True) for _ in range(total // slab)]
    return [slabs[i][at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
            for t, (i, at) in zip(tensors, places)]


def pinned_slabs(sizes: list) -> tuple:
    """-> (bytes in all, slab bytes, (slab, offset) of each size): torch's pinned allocator rounds each allocation up
    to a power of two (a 136 MB weight takes 256 MiB: 1.9x over a 7B's moments), so --offload cuts its buffers, in
    order, from slabs of one power-of-two size, over a sixteenth of the total (a 7B's moments: 1.13x, layers 1.07x)."""
    sizes = [-(-size // 512) * 512 for size in sizes]  # (each view 512-byte aligned, for any dtype)
    slab = power_of_two(max([*sizes, sum(sizes) // 16, 1]))
    places, n, used = [], 0, 0
    for size in sizes:
        if used + size > slab:
            n, used = n + 1, 0
        places.append((n, used))
        used += size
    return slab * (n + 1) * bool(sizes), slab, places


def power_of_two(size) -> int:  # the smallest power of two >= size: what torch's pinned allocator gives a request
    return 1 << (math.ceil(size) - 1).bit_length()


def decoder_layers(model):  # the transformer blocks: the ModuleList of the most weights (not the longest: an MoE
    # layer's experts can outnumber the layers, as in transformers 4's Qwen2-MoE: 60 experts, 24 layers)
    return max((m for m in model.modules() if isinstance(m, nn.ModuleList)),
               key=lambda m: (sum(p.numel() for p in m.parameters()), len(m)))


def checkpoint_layers(model):  # non-reentrant: works in eval mode, unlike transformers' own, and under FSDP2
    for layer in decoder_layers(model):
        layer.forward = functools.partial(torch.utils.checkpoint.checkpoint, layer.forward, use_reentrant=False)


def outside_autocast(fn, hidden, dtype, *args, **kwargs):  # --bf16: a head computes in its weights' dtype (fp32)
    with torch.autocast(hidden.device.type, enabled=False):
        return fn(hidden.to(dtype), *args, **kwargs)


def fp32_head(model):  # --bf16: the lm_head in fp32, so the full logits and their post-processing are fp32
    head = model.get_output_embeddings()  # (a partial over the head itself: its deep copy, as a bf16 sampler's,
    head.forward = functools.partial(own_dtype_forward, head)  # computes in its own dtype)


def own_dtype_forward(head, hidden):  # fp32_head's: the head's own forward outside autocast, in its weights' dtype
    return outside_autocast(functools.partial(type(head).forward, head), hidden, head.weight.dtype)


def autocast(cfg: Config, device):  # --bf16: the trainer's forwards in bf16 autocast, its weights and Adam in fp32
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16)


def make_optimizers(cfg: Config, policy, critic):  # AdamW per model (eps 1e-5: N+), decayed linearly to 0 over --steps
    optimizers = [torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, eps=cfg.adam_eps,
                                    weight_decay=cfg.weight_decay, fused=True)  # one kernel for all, CPU and CUDA
                  for model, lr in ((policy, cfg.lr), (critic, cfg.critic_lr)) if model is not None]
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: max(0.0, 1.0 - step / cfg.steps) if cfg.lr_decay
                                                   else 1.0) for o in optimizers]
    return optimizers[0], optimizers[1] if critic is not None else None, schedules


def wrap_for_training(model, cfg: Config):  # torchrun: DDP, or --fsdp FSDP2
    if not torch.distributed.is_initialized():
        return model
    device = next(model.parameters()).device
    if cfg.fsdp:  # --offload: FSDP2's CPUOffloadPolicy, the fp32 weights, gradients and Adam's step on the host
        return fsdp_shard(model, offload=cfg.offload)
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def fsdp_shard(model, group=None, offload=False, **options):  # FSDP2 over group's ranks (None: all): each decoder
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # layer, then the root
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    options.update({"offload_policy": CPUOffloadPolicy()} if offload else {})  # (pinned; each layer gathered as used)
    kind = next(model.parameters()).device.type  # a mesh of it: without one, fully_shard moves a CPU run to cuda:0
    world = torch.distributed.get_world_size()
    mesh = DeviceMesh.from_group(group, kind) if group else init_device_mesh(kind, (world,))
    # (the outputs of Actor and ScalarHeadModel are views, and nothing modifies them in place: only sliced, masked)
    warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def reshard(model):  # FSDP2 (of older torch too) keeps the root's weights gathered after a no-grad forward
    getattr(model, "reshard", lambda: None)()


def shards_frozen(cfg: Config, device) -> bool:
    """--fsdp: the reference and the reward model are sharded too, each forward all-gathering their weights. Not on
    CUDA with --max-staleness > 0: their forwards would run in the sampler thread beside the trainer's collectives on a
    second NCCL communicator, and NCCL does not order two communicators' kernels (a hang). Gloo's are CPU threads."""
    return cfg.fsdp and (device.type != "cuda" or cfg.max_staleness == 0)


# ----------------------------------------------------------------------------------------------------------------
# prompts and rewards


@dataclass
class Task:
    """What a task gives a run through the interfaces a user has too, each part where no flag gives it: --task
    module:factory names factory(cfg) -> Task; the built-in demo is addition_task (the end of this file)."""
    prompts: list = None  # training prompt texts (as --prompts)
    reward: object = None  # (prompts, completions, **facts) -> a score (or per-token rewards) each (as --reward)
    model: object = None  # cfg -> (tokenizer, causal LM) (as --model)
    warmup: object = None  # (policy, tokenizer, cfg): before the reference and the critic copy the policy
    evaluate: object = None  # (policy, tokenizer, cfg) -> {"eval_accuracy": x, "eval_...": y}: held-out scores,
    # before PPO and every --eval-every iterations, logged and printed


def load_task(cfg: Config) -> Task:  # --task: a name in TASKS, or 'module:factory'
    if not cfg.task:
        return Task()
    factory = TASKS.get(cfg.task) or load_function(cfg.task, "--task")
    try:
        task = factory(cfg)
    except Exception as e:
        raise SystemExit(f"--task {cfg.task!r}: its factory raised {type(e).__name__}: {e}")
    if not isinstance(task, Task):
        raise SystemExit(f"--task {cfg.task!r}: the factory returned a {type(task).__name__}, not a ppo_tokens.Task")
    return task


def load_prompts(path: str):
    prompts = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    prompts.append(str(json.loads(line)["prompt"]))
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"--prompts {path}: cannot read it as UTF-8 text ({e})")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise SystemExit(f"--prompts {path}: line {n} is not a JSON object with a 'prompt' field ({e})")
    if not prompts:
        raise SystemExit(f"--prompts {path}: the file holds no prompts")
    return prompts


def load_function(spec: str, flag="--reward"):  # 'module:name', the module from the current directory or sys.path
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise SystemExit(f"{flag} {spec!r}: expected 'module:function', e.g. my_module:{flag[2:]}")
    sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), fn_name)
    except Exception as e:  # (an import runs the module: any error)
        raise SystemExit(f"{flag} {spec!r}: cannot load it ({type(e).__name__}: {e})")


def load_env(spec: str):  # -> the factory, checked once: it makes an environment with reset() and step()
    factory = ENVIRONMENTS.get(spec) or load_function(spec, "--env")
    try:
        env = factory()
    except Exception as e:
        raise SystemExit(f"--env {spec!r}: its factory raised {type(e).__name__}: {e}")
    if not all(callable(getattr(env, name, None)) for name in ("reset", "step")):
        raise SystemExit(f"--env {spec!r}: the factory made a {type(env).__name__}, which lacks reset() or step()")
    getattr(env, "close", lambda: None)()
    return factory


def format_prompts(tokenizer, texts, use_chat_template: bool, max_prompt_length: int):
    """Token ids per prompt, in the chat template if any; long ones keep their last tokens (the question)."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(texts)["input_ids"]
    empty = [i for i, x in enumerate(ids) if not x]
    if empty:  # (a tokenizer without BOS, e.g. Qwen's or GPT-2's, and no chat template)
        raise SystemExit(f"{len(empty)} of {len(ids)} prompts are no tokens to the tokenizer (the first is prompt "
                         f"{empty[0] + 1}, {texts[empty[0]]!r}); remove them, or use a chat template or a BOS")
    cut = [i for i, x in enumerate(ids) if len(x) > max_prompt_length]
    if cut:
        print(f"warning: {len(cut)} of {len(ids)} prompts are longer than --max-prompt-length {max_prompt_length} "
              "tokens and keep only their last tokens")
    return [x[-max_prompt_length:] for x in ids]


def left_pad(seqs, pad_id: int, device):  # -> (ids, mask), (B, P): every prompt ends at column P - 1
    P = max(len(s) for s in seqs)
    ids = torch.tensor([[pad_id] * (P - len(s)) + list(s) for s in seqs], dtype=torch.long, device=device)
    return ids, torch.tensor([[0] * (P - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long, device=device)


def prompt_order(n: int, seed: int, start: int = 0):  # endless epochs, each a fresh random order; skip `start`
    generator = torch.Generator().manual_seed(seed)
    epochs = (i for _ in itertools.count() for i in reversed(torch.randperm(n, generator=generator).tolist()))
    return itertools.islice(epochs, start, None)


def sampling_args(cfg: Config, pad_id: int, stop_ids, vocab=None) -> dict:  # generate()'s keyword arguments
    return dict(max_new_tokens=cfg.response_length, temperature=cfg.temperature, stop_ids=stop_ids, pad_id=pad_id,
                top_k=cfg.top_k, top_p=cfg.top_p, vocab=vocab, policy_version=0)


@torch.no_grad()
def reward_model_scores(reward_model, rm_tokenizer, policy_tokenizer, batch, use_chat_template, micro_batch_size):
    """Each sequence's score at its last real token: our tokens if the vocabularies match, else re-tokenized text."""
    if same_vocabulary(rm_tokenizer, policy_tokenizer):
        ids, mask, _ = full_sequence(batch)
    else:
        if use_chat_template and getattr(rm_tokenizer, "chat_template", None):
            texts = []
            for p, c, ended in zip(batch.prompts, batch.completions, batch.ended.tolist()):
                chat = [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
                try:  # a completion cut at --response-length stays an open assistant turn: no end-of-turn after it
                    text = rm_tokenizer.apply_chat_template(chat, tokenize=False, continue_final_message=not ended)
                except ValueError:  # a template that rewrites the assistant text (drops a <think> part) cannot
                    text = rm_tokenizer.apply_chat_template(chat, tokenize=False)
                texts.append(text)
            seqs = rm_tokenizer(texts, add_special_tokens=False)["input_ids"]
        else:
            eos = [(rm_tokenizer.eos_token or "") if e else "" for e in batch.ended.tolist()]
            seqs = rm_tokenizer([p + c + e for p, c, e in zip(batch.prompts, batch.completions, eos)])["input_ids"]
        ids, mask = left_pad(seqs, rm_tokenizer.pad_token_id or 0, batch.response.device)
    last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(-1)  # (B,) last real column
    scores = []
    for rows in torch.arange(ids.shape[0], device=ids.device).split(micro_batch_size):
        out = reward_model(ids[rows], mask[rows], positions(mask[rows]))  # (b, L)
        scores.append(out.gather(1, last[rows, None]).squeeze(1))
    reshard(reward_model)
    return torch.cat(scores)


def with_facts(fn, *args, **facts):  # fn(*args, **the facts it names), all of them if it takes **kwargs
    parameters = inspect.signature(fn).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        facts = {k: v for k, v in facts.items() if k in parameters}
    return fn(*args, **facts)


def rule_scores(rule, batch: Rollout):
    """(B,) a reward function's scores, checked. It gets prompts and completions and, where it names them (or takes
    **kwargs), completion_ids (the stop token excluded) and ended (it emitted a stop token). Per completion it returns
    a score, or a list of rewards, one per completion id (a process reward): each lands on its token
    (batch.token_rewards), and the score is their sum."""
    ids = completion_ids(batch)
    try:
        scores = list(with_facts(rule, batch.prompts, batch.completions, completion_ids=ids,
                                 ended=batch.ended.tolist()))
    except Exception as e:
        raise SystemExit(f"the reward function raised {type(e).__name__}: {e}")
    if len(scores) != len(batch.completions):
        raise SystemExit(f"the reward function returned {len(scores)} scores for {len(batch.completions)} completions")
    token_rewards = torch.zeros(batch.response.shape, dtype=torch.float32)  # (B, T)
    for r in [r for r, score in enumerate(scores) if isinstance(score, (list, tuple))]:  # (a tensor, a number: one)
        if len(scores[r]) != len(ids[r]):
            raise SystemExit(f"the reward function returned {len(scores[r])} rewards for completion {r}, which has "
                             f"{len(ids[r])} tokens (completion_ids): give one per token, or one score")
        token_rewards[r, :len(ids[r])] = torch.tensor(scores[r], dtype=torch.float32)
        scores[r] = token_rewards[r].sum()
    try:
        scores = torch.tensor([float(s) for s in scores], dtype=torch.float32, device=batch.response.device)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"the reward function must return a list of numbers, or of lists of numbers ({e})")
    batch.token_rewards = token_rewards.to(batch.response.device)  # (zeros: the scores alone)
    return scores


def episode_return(batch: Rollout):  # --env's score: the sum of each episode's rewards (run_episodes' token_rewards)
    return batch.token_rewards.sum(-1)


# ----------------------------------------------------------------------------------------------------------------
# environments (--env): multi-turn rollouts through Gymnasium's API over text


def env_step(env, action: str, latency: float, facts: dict):
    """One row's step, in the pool: (observation, reward, done, its role, error or None). A step that raises or
    returns no text ends its row (truncated) with the error, which make_batch counts."""
    time.sleep(latency)
    try:
        observation, reward, terminated, truncated, info = with_facts(env.step, action, **facts)
        if not isinstance(observation, str):
            raise TypeError(f"step() returned a {type(observation).__name__} observation, not a str")
        return observation, float(reward), bool(terminated or truncated), (info or {}).get("role", "user"), None
    except Exception as e:
        return "", 0.0, True, "", f"{type(e).__name__}: {str(e)[:200]}"


def observation_ids(tokenizer, text: str, role: str, chat: bool, stop_id: int) -> list:
    """An observation's tokens after a turn that ended with stop_id: the text's own, or (chat) what the template
    writes after that stop for a `role` message (a tool's, a user's) and the assistant header that follows it.
    Raises ValueError for a template that rewrites earlier turns (the conversation would not be one sequence)."""
    if not chat:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    turn = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
    before = tokenizer.apply_chat_template(turn, tokenize=False)
    after = tokenizer.apply_chat_template([*turn, {"role": role, "content": text}], tokenize=False,
                                          add_generation_prompt=True)
    end, stop = before.rfind("!") + 1, tokenizer.decode([stop_id])
    if not after.startswith(before):
        raise ValueError("the chat template rewrites earlier turns when a message follows (use --no-chat-template)")
    end += len(stop) if before.startswith(stop, end) else 0  # another stop id: the template's end of turn after it
    return tokenizer(before[end:] + after[len(before):], add_special_tokens=False)["input_ids"]


@dataclass
class Episode:  # one row's state in run_episodes
    context: list  # the conversation so far (token ids): the next turn's prompt
    pieces: list = field(default_factory=list)  # its (ids, policy mask, log-probs, kept ids) chunks, turn by turn
    used: int = 0  # response columns taken by its turns and observations, of --response-length
    rewards: list = field(default_factory=list)  # (column, reward): each turn's, on its last token
    ended: bool = False  # its last turn emitted a stop id
    error: str = None  # why its environment failed


@torch.no_grad()
def run_episodes(decoder, envs, texts, seeds, tokenizer, cfg: Config, pool=None, resize=None, **sampling) -> Rollout:
    """Multi-turn rollouts: envs[i] (Gymnasium's reset / step over text) plays row i. Each turn re-prefills the
    conversation so far in generate(), so both decoders serve it as they are; a turn ends at a stop id; the
    environments step concurrently in `pool` (a tool call mostly waits); observations are appended as context
    (response_mask 0). A row ends when its environment is done, at --max-turns, after a turn without a stop id, or when
    its --response-length budget (turns and observations) runs out. resize(columns): a static decoder with that many
    columns, for first observations longer than it was sized for. -> a Rollout with context_mask and token_rewards."""
    B, T, pad, mapper = len(envs), cfg.response_length, sampling["pad_id"], pool.map if pool else map
    with contextlib.ExitStack() as closing:  # each environment closed at the end, or on an error (a sandbox, a
        for env in envs:  # subprocess: its resources go now), each even if another's close() raised
            closing.callback(getattr(env, "close", lambda: None))
        try:
            def reset(env, prompt, seed):  # its error returned: every reset ends before any close
                try:
                    return env.reset(prompt, seed=seed)
                except BaseException as e:  # (sys.exit too: the others' resets still end first)
                    return e
            first = list(mapper(reset, envs, texts, seeds))
            for x in first:
                if isinstance(x, BaseException):
                    raise x
                if not (isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], str)):  # (not a bare str)
                    raise TypeError("it must return (the first observation, a str; info)")
            first = [x[0] for x in first]
        except Exception as e:  # (no episode has begun: nothing to keep)
            raise SystemExit(f"--env: reset() raised {type(e).__name__}: {e}")
        prompts = format_prompts(tokenizer, first, cfg.chat_template, cfg.max_prompt_length)
        columns = max(map(len, prompts)) + 2 * T  # what a turn may fill: its (padded) context, then up to T tokens
        if isinstance(decoder, StaticDecoder) and columns > decoder.max_len:  # (a reset() longer than every prompt)
            if resize is None:
                fall_back(f"--env: first observations of up to {columns - 2 * T} tokens and a budget of {T} need "
                          f"{columns} columns, more than the static cache's {decoder.max_len}: this batch samples with "
                          "the plain loop")
            decoder = PlainDecoder(decoder.model) if resize is None else resize(columns)
        chat = cfg.chat_template and getattr(tokenizer, "chat_template", None) is not None
        rows = [Episode(list(p)) for p in prompts]
        active, device = list(range(B)), sampling["generator"].device
        for turn in range(cfg.max_turns):
            budget = [T - rows[r].used for r in active]
            ids, mask = left_pad([rows[r].context for r in active], pad, device)
            if isinstance(decoder, StaticDecoder):  # its batch size: finished rows' places go to one-token copies
                fill = decoder.mask.shape[0] - len(active)
                ids, mask = (torch.cat([x, x[:1].expand(fill, -1)]) for x in (ids, mask))
                budget += [1] * fill
            out = generate(decoder, ids, mask, **{**sampling, "max_new_tokens": max(budget),
                                                  "budgets": torch.tensor(budget, device=device)})
            actions, facts = [], []
            lengths = out.response_mask.sum(1).tolist()
            for i, (r, turn_ids, n, stop) in enumerate(zip(active, out.response.tolist(), lengths,
                                                           out.ended.tolist())):  # (the host reads once a turn)
                row = rows[r]
                kept = None if out.kept_ids is None else out.kept_ids[i, :n]
                row.pieces.append((out.response[i, :n], torch.ones(n, dtype=torch.long, device=device),
                                   out.behav_logprobs[i, :n], kept))
                row.used, row.ended, row.context = row.used + n, stop, row.context + turn_ids[:n]
                facts.append({"completion_ids": turn_ids[:n - stop], "ended": stop})
                actions.append(tokenizer.decode(facts[-1]["completion_ids"], skip_special_tokens=True))
            steps = list(mapper(env_step, [envs[r] for r in active], actions, [cfg.env_latency] * len(active), facts))
            observed = {}  # the rows that go on, and their observations' ids
            for r, (observation, reward, done, role, error) in zip(active, steps):
                row = rows[r]
                row.rewards.append((row.used - 1, reward))
                row.error = error
                if done or not row.ended or turn == cfg.max_turns - 1:
                    continue
                try:  # (a template that refuses the role: this row's error)
                    obs = observation_ids(tokenizer, observation, role, chat, row.context[-1])
                except Exception as e:
                    row.error = f"the observation: {type(e).__name__}: {str(e)[:200]}"
                    continue
                if row.used + len(obs) < T:  # room for the observation and a token after it (else truncated)
                    observed[r] = obs
            all_ids = torch.tensor([x for obs in observed.values() for x in obs], dtype=torch.long).to(device)  # (once)
            for (r, obs), ids in zip(observed.items(), all_ids.split([len(obs) for obs in observed.values()])):
                row, n, width = rows[r], len(obs), None if out.kept_ids is None else out.kept_ids.shape[2]
                row.used, row.context = row.used + n, row.context + obs
                kept = None if width is None else torch.cat([ids[:, None], ids.new_full((n, width - 1), -1)], 1)
                row.pieces.append((ids, torch.zeros_like(ids), torch.zeros(n, device=device), kept))  # (kept: itself)
            active = list(observed)
            if not active:
                break

    def field(k, fill):  # the rows' chunks of field k, each row right-padded to T columns: (B, T, ...)
        chunks = [torch.cat([chunk[k] for chunk in row.pieces]) for row in rows]
        out = torch.full((B, T, *chunks[0].shape[1:]), fill, dtype=chunks[0].dtype, device=device)
        for r, x in enumerate(chunks):
            out[r, :len(x)] = x
        return out
    response, kept_ids = field(0, pad), None if rows[0].pieces[0][3] is None else field(3, -1)
    batch = Rollout(*left_pad(prompts, pad, device), response=response, response_mask=field(1, 0),
                    behav_logprobs=field(2, 0.0), policy_version=torch.full_like(response, sampling["policy_version"]),
                    ended=torch.tensor([row.ended for row in rows], device=device), kept_ids=kept_ids)
    used = torch.tensor([row.used for row in rows])
    batch.context_mask = (torch.arange(T) < used[:, None]).long().to(device)
    token_rewards = torch.zeros(B, T)
    for r, row in enumerate(rows):
        for column, reward in row.rewards:
            token_rewards[r, column] = reward
    batch.token_rewards = token_rewards.to(device)  # (one copy)
    batch.completions = tokenizer.batch_decode([ids[:row.used] for ids, row in zip(response.tolist(), rows)],
                                               skip_special_tokens=True)
    batch.episodes = {"rewards": [[x for _, x in row.rewards] for row in rows], "errors": [row.error for row in rows]}
    return batch


# ----------------------------------------------------------------------------------------------------------------
# the overlapped loop's machinery: sampler thread, bounded queue, packed weight sync, timing
# Generation dominates RL wall-clock time, so (as verl, AReaL, PipelineRL, PRIME-RL) a sampler copy of the policy
# generates the next batches while the trainer updates. A thread: every PyTorch op releases the GIL, and on CUDA the
# two threads' kernels go to separate streams and overlap, with no hand-picked yield points.


def sampler_copy(policy, dtype):
    """The sampler's inference copy of the policy, bf16 on GPU, else dtype, no gradients -> (it, the flat buffer every
    parameter of it is a view of: a weight sync is one copy). Made in that buffer: never two copies of the weights."""
    dtype = torch.bfloat16 if policy.device.type == "cuda" else dtype  # (one dtype: one flat buffer)
    flat = torch.empty(sum(p.numel() for p in policy.parameters()), dtype=dtype, device=policy.device)
    sampler = tree_over(policy, flat)
    for mine, theirs in zip(sampler.parameters(), policy.parameters()):  # (each tied weight once, in one order)
        mine.data.copy_(theirs.data)
    if policy.device.type == "cpu" and dtype == torch.bfloat16:  # torch's CPU bf16 linear of a strided input
        # (logits_to_keep's (B, 1, H) slice) allocates ~15 bytes a weight for a moment: +2 GiB at every prefill for
        # Qwen2.5-0.5B's 152k-token head (fp32: no; and its rounding, unlike a copy's, is what fp32 runs have)
        sampler.get_output_embeddings().register_forward_pre_hook(lambda head, args: (args[0].contiguous(),))
    return sampler, flat


def tree_over(model, flat):  # the module tree again, its parameters views of flat, in order (buffers: copied)
    params = list(model.parameters())
    return copy.deepcopy(model, memo={id(p): nn.Parameter(piece.view_as(p), requires_grad=False)
                                      for p, piece in zip(params, flat.split([p.numel() for p in params]))})


def cast_parameters(model, dtype):  # the parameters only: buffers (RoPE frequencies, ...) keep their fp32 precision
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def flatten_parameters(model):  # every parameter becomes a view of one flat buffer: a weight sync is one copy
    params = list(model.parameters())  # each tied weight once
    flat = nn.utils.parameters_to_vector(params).detach()
    nn.utils.vector_to_parameters(flat, params)  # (which makes each parameter a view of flat)
    return flat


class WeightSync:
    """Trainer -> sampler weights through a staging buffer, so the trainer updates on while the sampler still
    generates with the previous version; the lock covers one copy (~1 ms), never a decode. direct (--max-staleness 0):
    the sampler never generates while the trainer publishes, so a publish writes the sampler's weights (no staging
    copy: a model's worth of memory less)."""

    def __init__(self, policy, sampler_flat, sharded=False, merged=None, direct=False):
        self.policy, self.merged = policy, merged  # merged: () -> the sampler's weights, one by one (--lora-rank)
        self.sampler_flat = sampler_flat  # (sampler_copy's: every sampler parameter is a view of it)
        self.trainer_flat = None if sharded or merged else flatten_parameters(policy)
        self.staging = self.sampler_flat if direct else self.sampler_flat.clone()
        self.cuda = self.sampler_flat.is_cuda
        self.lock = threading.Condition()
        self.version = 0  # the newest published
        self.sampler_version = -1  # the one in the sampler's weights (none yet: the first pull copies)
        self.seconds = {"publish": 0.0, "pull": 0.0}  # each copy's last duration (fixed keys: two threads write it)

    @torch.no_grad()
    def _copy(self, name: str, dst, src):  # dst <- src on this thread's stream (src None: the sharded trainer's)
        if self.cuda:  # (this stream's earlier work is not the copy's time)
            torch.cuda.current_stream().synchronize()
        start = time.perf_counter()
        if src is not None:
            dst.copy_(src)
        elif self.merged is not None:  # each base weight + its adapter's, straight into its slice of dst
            offset = 0
            for w in self.merged():
                dst[offset:offset + w.numel()].copy_(w.reshape(-1))
                offset += w.numel()
        else:  # FSDP2: torch.cat([p.full_tensor().reshape(-1) for p in params]), in one collective (kernels.py)
            kernels.gather_shards(list(self.policy.parameters()), dst)
        if self.cuda:  # done before the lock is released, so the other thread's next copy (its stream) comes after it
            torch.cuda.current_stream().synchronize()
        self.seconds[name] = time.perf_counter() - start

    def publish(self, version: int):  # trainer thread, after the optimizer steps of an update
        with self.lock:
            self._copy("publish", self.staging, self.trainer_flat)
            self.version = version
            self.lock.notify_all()

    def pull(self) -> int:  # sampler thread, between batches (or decode steps): take the newest version
        with self.lock:
            if self.version != self.sampler_version:
                if self.staging is not self.sampler_flat:  # (direct: the publish wrote it)
                    self._copy("pull", self.sampler_flat, self.staging)  # every sampler parameter is a view of it
                self.sampler_version = self.version
            return self.sampler_version

    def sync_ms(self) -> float:  # the last publish's + the last pull's copy time
        return 1e3 * sum(self.seconds.values())

    def wait_for(self, version: int, stop: threading.Event):  # sampler: block until `version` is published
        with self.lock:
            while self.version < version and not stop.is_set():
                self.lock.wait(0.05)


class Timer:
    """Busy and waiting seconds of both threads per iteration (the log's trainer_busy_s, sampler_wait_s, ...)."""

    def __init__(self):
        self.totals = {}  # busy / wait seconds per side since the last take()
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def span(self, name: str, side: str):  # side: "trainer" or "sampler"; names "wait..." count as waiting
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"{side}_{'wait' if name.startswith('wait') else 'busy'}_s"
            with self.lock:
                self.totals[key] = self.totals.get(key, 0.0) + time.perf_counter() - start

    def take(self) -> dict:  # the totals since the last take, once per iteration
        with self.lock:
            totals, self.totals = self.totals, {}
        return totals


class Producer:
    """make_batch(t, i) in a thread at most max_staleness versions ahead (or inline); its exceptions re-raise here."""

    def __init__(self, t):  # t: train()'s Training
        self.t = t
        self.queue = queue.Queue(maxsize=max(1, t.cfg.max_staleness))
        self.stop = threading.Event()
        self.next_index = t.start
        # the sampler's own CUDA stream, which must see the sampler's weights that the default stream copied in
        self.stream = torch.cuda.Stream() if t.sync.cuda else None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
        self.thread = None
        self.threads = torch.get_num_threads()  # the trainer's intra-op threads, given back by close()
        if t.threaded and self.stream is None:  # CPU: the sampler thread takes one core, the trainer the others
            torch.set_num_threads(max(1, self.threads - 1))
        if t.threaded:
            self.thread = threading.Thread(target=self._run, daemon=True, name="ppo_tokens-sampler")
            self.thread.start()

    def _produce(self, i: int):
        with self.t.timer.span("wait for weights", "sampler"):
            self.t.sync.wait_for(i - self.t.cfg.max_staleness, self.stop)
        with torch.cuda.stream(self.stream):  # None (CPU): a no-op
            return make_batch(self.t, i, self.stop)

    def _run(self):
        if self.stream is None:  # CPU: the Python-bound decode needs one core; the trainer keeps the others
            torch.set_num_threads(1)  # (intra-op threads are per calling thread)
        else:  # a new thread's current device is cuda:0; torch.cuda.stream() would set it and open a context there
            torch.cuda.set_device(self.stream.device)
        try:
            for i in range(self.t.start, self.t.cfg.steps):
                batch = self._produce(i)
                with self.t.timer.span("wait for queue space", "sampler"):
                    self._put(batch)
        except BaseException as e:  # SystemExit from a reward check too: hand it to the trainer
            self._put(e)

    def _put(self, item):
        while not self.stop.is_set():
            try:
                return self.queue.put(item, timeout=0.05)
            except queue.Full:
                pass

    def get(self) -> Rollout:
        if self.thread is None:
            item = self._produce(self.next_index)
            self.next_index += 1
        else:
            with self.t.timer.span("wait for a batch", "trainer"):  # _run puts every batch, or its exception
                item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        if self.stream is not None:  # memory made on the sampler's stream, now also used on the trainer's
            for t in vars(item).values():
                if isinstance(t, torch.Tensor) and t.is_cuda:  # (not sampler_rng, a CPU generator's state)
                    t.record_stream(torch.cuda.current_stream())
        return item

    def close(self):
        self.stop.set()  # make_batch checks it between decode steps
        if self.thread is not None:
            self.thread.join(timeout=30)
            if self.thread.is_alive():
                print("warning: the sampler thread did not stop within 30 s")
        torch.set_num_threads(self.threads)


def micro_batch_rows(batch: Rollout, minibatches, cfg: Config, ranks_agree=False, group=None):
    """Each minibatch's rows in micro-batches (--micro-batch-size rows, or --micro-batch-tokens' token_budget_bins).
    ranks_agree: as many micro-batches per minibatch on every rank (one collective, on group: None = the trainer's)."""
    if not cfg.micro_batch_tokens:
        return [list(rows.split(cfg.micro_batch_size or len(rows))) for rows in minibatches]
    lengths = full_sequence(batch)[1].sum(1).tolist()
    groups = [token_budget_bins([lengths[r] for r in rows.tolist()], cfg.micro_batch_tokens) for rows in minibatches]
    counts = torch.tensor([len(g) for g in groups], device=batch.response.device)
    counts = all_reduce(counts, "max", group).tolist() if ranks_agree else counts.tolist()
    groups = [token_budget_bins([lengths[r] for r in rows.tolist()], cfg.micro_batch_tokens, n) if n > len(g) else g
              for rows, g, n in zip(minibatches, groups, counts)]
    return [[rows[torch.tensor(g, device=rows.device)] for g in gs] for rows, gs in zip(minibatches, groups)]


# ----------------------------------------------------------------------------------------------------------------
# the loop's bookkeeping: start-up and resume, the producer's batches, logging, checkpoints, the stop signal


@dataclass
class Training:
    """What train() carries from one iteration to the next; start_training builds it."""
    cfg: Config
    run: object  # setup()'s models, tokenizer, prompts and reward
    ctx: Dist
    output_dir: str
    actor: nn.Module  # Actor(policy), wrapped in DDP / FSDP2 under torchrun
    critic: nn.Module  # wrapped likewise
    optimizers: tuple  # (the policy's AdamW, the critic's)
    schedules: list  # their learning-rate schedules
    sync: WeightSync  # trainer -> sampler weights
    evaluator: nn.Module  # what the task evaluates: the policy, or under FSDP2 a tree over the published weights
    rank_rows: slice  # this rank's rows of every batch
    sample_generator: torch.Generator  # sampling, offset per rank
    shuffle_generator: torch.Generator  # minibatch row orders
    threaded: bool  # the producer samples in a thread of its own
    start: int = 0  # iterations done before this process (a resume)
    elapsed: float = 0.0  # seconds of run time before this process
    first_accuracy: float = None  # the task's held-out accuracy before PPO
    last_checkpoint: str = None
    history: list = field(default_factory=list)  # the iteration records
    bad_steps: int = 0  # consecutive updates skipped for non-finite values
    order: object = None  # the prompt order: an endless iterator of prompt indices
    prompts_drawn: int = 0  # from it so far (by the producer, which may run ahead)
    decoder: object = None  # what the sampler generates with (fast_decoder)
    logger: object = None
    timer: Timer = None
    producer: Producer = None
    pool: object = None  # --env: the threads the environments step in
    sampler_group: object = None  # torchrun: the producer's own process group (gloo), for its collectives
    frozen_group: object = None  # shards_frozen: the producer's group for the frozen models' all-gathers
    run_start: float = 0.0  # time.time() at which the run (before a resume included) started
    window_start: float = 0.0  # the end of the last iteration: an iteration's window ends at the end of the next

    def close(self):  # on the way out, also on an error or Ctrl-C: stop and join the sampler, close the log
        if self.producer is not None:
            self.producer.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.logger.close()


def start_training(cfg: Config, run, output_dir: str, threaded, ctx: Dist) -> Training:
    """train()'s state: the sampler copy and its weight sync, the trained models and optimizers; with --resume the
    checkpoint's weights, optimizer states, schedules, generators, metrics and run time."""
    policy, device = run.policy, run.device
    base = run.reference.policy if run.lora else None  # --lora-rank: the sampler has the base's tree, merged weights
    sampler, flat = sampler_copy(policy if base is None else base, trained_dtype(cfg))  # (--lora-rank: with its head)
    sharded = cfg.fsdp and torch.distributed.is_initialized()
    merged = None if base is None else functools.partial(merged_weights, policy)
    sync = WeightSync(policy, flat, sharded, merged, direct=cfg.max_staleness == 0)  # packs the trainer's weights
    # FSDP2: the task evaluates the published weights (which only this thread writes), not the sampler's own
    evaluator = tree_over(sampler, sync.staging) if sharded and run.task.evaluate is not None and ctx.rank == 0 \
        else None
    trained = [m for m in (policy, run.critic) if m is not None]
    for model in trained if cfg.gradient_checkpointing else ():  # (not the sampler copy, made above)
        checkpoint_layers(model)
    for model in (policy, run.reference.policy) if cfg.bf16 else ():  # (the reference's too where fp32: --lora-rank's
        if model.get_output_embeddings().weight.dtype == torch.float32:  # shares the policy's; --dtype float32)
            fp32_head(model)
    actor = wrap_for_training(Actor(policy, cfg.temperature, cfg.full_logits, run.vocab), cfg)
    critic = wrap_for_training(run.critic, cfg) if run.critic is not None else None
    policy_opt, critic_opt, schedules = make_optimizers(cfg, actor, critic)
    for optimizer in [o for o in (policy_opt, critic_opt) if o is not None and cfg.offload and not sharded]:
        offload_moments(optimizer)  # (FSDP2's CPUOffloadPolicy holds them on the host with the weights)
    n_trained = sum(p.numel() for m in trained for p in m.parameters() if p.requires_grad)
    print(f"trainable parameters: {n_trained / 1e6:.2f}M ({' + '.join(type(m).__name__ for m in trained)})")

    # the same prompt order on every rank, each taking its slice; sampling differs per rank (a seed offset)
    rank_rows = slice(ctx.rank * cfg.batch_size // ctx.world, (ctx.rank + 1) * cfg.batch_size // ctx.world)
    threaded = cfg.max_staleness > 0 if threaded is None else threaded
    t = Training(cfg, run, ctx, output_dir, actor, critic, (policy_opt, critic_opt), schedules, sync,
                 evaluator if evaluator is not None else policy, rank_rows,
                 torch.Generator(device).manual_seed(cfg.seed + 1_000_003 * ctx.rank),
                 torch.Generator().manual_seed(cfg.seed + 1), threaded, decoder=sampler, timer=Timer())
    if cfg.resume:
        state = load_checkpoint(cfg.resume, actor, critic, t.optimizers, schedules, ctx, device)
        t.start = state["step"]
        t.first_accuracy = state["first_accuracy"]
        t.elapsed = state["time_s"]
        t.prompts_drawn = state.get("prompts_drawn", t.start * (cfg.batch_size // cfg.samples_per_prompt))
        t.bad_steps = state.get("bad_steps", 0)  # (a signal's checkpoint may follow skipped updates)
        t.last_checkpoint = cfg.resume
        t.sample_generator.set_state(state["sampler_rng"])
        t.shuffle_generator.set_state(state["shuffle_rng"])
        if ctx.rank == 0:
            t.history = restore_metrics(output_dir, t.start)
            for newer in [c for c in checkpoints(output_dir) if c > cfg.resume]:  # step-N names sort by step
                # set aside, not deleted: this run writes its own (the nanoseconds: two resumes within a second)
                stamp = f"{time.strftime('%Y%m%d-%H%M%S')}.{time.time_ns() % 10**9}"
                aside = f".abandoned-{os.path.basename(newer)}-{stamp}"
                os.replace(newer, os.path.join(os.path.dirname(newer), aside))
                print(f"resume: set aside {newer}, newer than the checkpoint resumed from (now .abandoned-*)")
        print(f"resumed from {cfg.resume} after iteration {t.start}/{cfg.steps}")
    sync.publish(t.start)  # the sampler starts from the trainer's (maybe just loaded) weights, as version `start`
    sync.pull()
    if ctx.rank == 0:
        write_file(os.path.join(output_dir, "config.json"), json.dumps(dataclasses.asdict(cfg), indent=2))
    if torch.distributed.is_initialized():  # (a thread's collectives on the trainer's group could interleave)
        t.sampler_group = torch.distributed.new_group(backend="gloo")
    if sharded and shards_frozen(cfg, device):  # each rank holds 1 / world of them; a forward gathers the rest
        # (CUDA: the trainer's own group, as they run inline, between its collectives; gloo: the producer's)
        t.frozen_group = t.sampler_group if device.type == "cpu" else torch.distributed.group.WORLD
        for model in (run.reference, run.reward_model):
            if model is not None:
                fsdp_shard(model, t.frozen_group, cfg.offload, reshard_after_forward=True)  # (the root too: it waits)
        print(f"reference{' and reward model' if run.reward_model else ''} sharded over {ctx.world} ranks (FSDP2)")
    elif sharded:
        print("reference and reward model replicated: --max-staleness > 0 on CUDA scores them in the sampler thread "
              "(shards_frozen)")
    t.logger = Logger(cfg, output_dir, enabled=ctx.rank == 0)
    t.order = prompt_order(len(run.prompt_ids), cfg.seed, start=t.prompts_drawn)
    if run.env is not None:  # a tool call mostly waits: as many threads as rows, each on the run's device, not cuda:0
        on_device = {"initializer": torch.cuda.set_device, "initargs": (device,)} if device.type == "cuda" else {}
        t.pool = concurrent.futures.ThreadPoolExecutor(rank_rows.stop - rank_rows.start, "ppo_tokens-env", **on_device)
    if cfg.static_cache:  # (--env: a turn's prefill is up to T columns longer for rows that have used fewer)
        static_decoder(t, max(map(len, run.prompt_ids)) + cfg.response_length * (2 if run.env else 1))
    return t


def static_decoder(t: Training, columns: int):  # the sampler's fast decoder for this rank's rows, `columns` long
    cpu_thread = t.threaded and t.sync.sampler_flat.device.type == "cpu"  # the sampler thread's one intra-op thread
    sampler = t.decoder.model if isinstance(t.decoder, StaticDecoder) else t.decoder
    if isinstance(t.decoder, StaticDecoder):  # --env: a reset() longer than every prompt (run_episodes)
        print(f"--env: the first observations need {columns} columns: the sampler's static cache grows to them")
    t.decoder = fast_decoder(sampler, t.rank_rows.stop - t.rank_rows.start, columns, PlainDecoder,
                             t.cfg.compile_sampler, threads=1 if cpu_thread else 0, group=t.cfg.samples_per_prompt)
    return t.decoder


def take_rows(batch: Rollout, rows: list, device) -> Rollout:  # batch.rows(rows) with its lists too, on `device`
    out = batch.rows(torch.tensor(rows, dtype=torch.long, device=batch.response.device))
    for name in ("prompts", "completions"):
        setattr(out, name, [getattr(batch, name)[r] for r in rows])
    out.episodes = None if batch.episodes is None else {k: [v[r] for r in rows] for k, v in batch.episodes.items()}
    for f in dataclasses.fields(out):
        if f.type is torch.Tensor and getattr(out, f.name) is not None:
            setattr(out, f.name, getattr(out, f.name).to(device))
    return out


def concat_rollouts(parts: list, pad_id: int) -> Rollout:
    """The rows of several batches as one: prompts left-padded to the longest, responses right-padded."""
    fields = {}
    for f in dataclasses.fields(Rollout):
        values = [getattr(part, f.name) for part in parts]
        if f.type is torch.Tensor and values[0] is not None:
            fill = pad_id if f.name in ("prompt_ids", "response") else -1 if f.name == "kept_ids" else 0
            fields[f.name] = torch.cat(values) if values[0].dim() == 1 else nn.utils.rnn.pad_sequence(
                [row for v in values for row in v], True, fill, "left" if f.name.startswith("prompt") else "right")
        elif isinstance(values[0], list):
            fields[f.name] = [x for v in values for x in v]
        elif f.name == "episodes" and values[0] is not None:
            fields[f.name] = {k: [x for v in values for x in v[k]] for k in values[0]}
    return Rollout(**fields)


def log_iteration(t: Training, step: int, batch: Rollout, kl, stats: dict, lr: float, update_s: float, sync_ms):
    """After a good update: evaluate (the task's hook), log and print the iteration's scalars over all ranks."""
    cfg = t.cfg
    t.bad_steps = 0
    scores = {}
    if t.run.task.evaluate is not None and (step % cfg.eval_every == 0 or step == cfg.steps) and t.ctx.rank == 0:
        with t.timer.span("evaluate", "trainer"):  # the last published weights
            scores = t.run.task.evaluate(t.evaluator, t.run.tokenizer, cfg)
    now = time.time()
    iter_s = now - t.window_start
    busy = {f"{side}_{what}_s": 0.0 for side in ("trainer", "sampler") for what in ("busy", "wait")}
    busy.update(t.timer.take())  # each thread's busy and waiting seconds in this iteration
    B, P, T = batch.response.shape[0], batch.prompt_ids.shape[1], batch.response.shape[1]
    response_tokens = int(batch.response_mask.sum())  # the policy's (--env: not the observations')
    sequence_tokens = int(full_sequence(batch)[1].sum())
    kl_means = global_masked_means([(kl.sum(-1), batch.loss_mask.any(1)), (kl, batch.loss_mask)])
    record = {"step": step,
              "reward_mean": float(batch.raw_scores.mean()),
              "kl": kl_means[0],  # per sequence, over the rows in the loss
              "kl_per_token": kl_means[1],
              **stats,  # ppo_update's losses, clip fractions, approx_kl, entropy, grad norms
              **({} if batch.returns is None else  # (an estimator without a critic)
                 {"explained_variance": float(explained_variance(batch.values, batch.returns, batch.response_mask))}),
              "response_length": response_tokens / B,
              "response_tokens": response_tokens,
              # the share of a padded (B, P + T) forward that is padding: what --micro-batch-tokens does not compute
              "padding_frac": 1.0 - sequence_tokens / (B * (P + T)),
              "eos_fraction": float(batch.ended.float().mean()),
              "lr": lr,
              **batch.correction,  # off_policy_correction's staleness and importance-weight statistics
              **batch.row_stats,  # the rows left out of the loss (choose_loss_tokens)
              "iter_s": iter_s,
              "gen_tokens_per_s": response_tokens / batch.gen_s,
              "train_tokens_per_s": cfg.ppo_epochs * sequence_tokens / update_s,
              "tokens_per_s": response_tokens / iter_s,  # end to end: what the overlap buys
              **busy,
              "trainer_idle_frac": max(0.0, 1.0 - busy["trainer_busy_s"] / iter_s),
              "overlap_frac": max(0.0, busy["trainer_busy_s"] + busy["sampler_busy_s"] - iter_s) / iter_s,  # both busy
              "weight_sync_ms": sync_ms,
              **peak_memory(t.run.device)}
    if t.run.env is not None:  # per episode: its turns, and whether its environment failed
        record["turns_mean"] = sum(map(len, batch.episodes["rewards"])) / B
        record["env_errors"] = sum(e is not None for e in batch.episodes["errors"])
    record = reduce_record(record, t.ctx.world)
    t.window_start = now
    record["time_s"] = now - t.run_start
    record.update(scores)  # rank 0's, after the reduction
    t.logger.log(record)
    t.history.append(record)
    acc = "".join(f" | {k[5:].replace('accuracy', 'acc')} {v:.3f}" for k, v in scores.items())
    critic = f" | vloss {record['vf_loss']:.4f} | ev {record['explained_variance']:.2f}" if "vf_loss" in record else ""
    memory = (f"peak {record['peak_memory_gb']:.1f} GB, " if "peak_memory_gb" in record else "") + \
        f"rss {record['peak_rss_gb']:.1f} GB"
    print(f"it {step:>4}/{cfg.steps} | reward {record['reward_mean']:.3f}{acc} | kl {record['kl']:.4f}"
          f" | ent {record['entropy']:.3f} | clip {record['clipfrac']:.3f}{critic}"
          f" | len {record['response_length']:.1f} | gen {record['gen_tokens_per_s']:.0f} tok/s"
          f" | train {record['train_tokens_per_s']:.0f} tok/s | idle {record['trainer_idle_frac']:.0%}"
          f" | {record['iter_s']:.2f}s | {memory}", flush=True)
    if cfg.sample_every and (step % cfg.sample_every == 0 or step == 1):
        shown = range(0, min(len(batch.prompts), 3 * cfg.samples_per_prompt), cfg.samples_per_prompt)  # one a group
        for p, c, s in ((batch.prompts[r], batch.completions[r], float(batch.scores[r])) for r in shown):
            print(f"    {p!r} -> {c!r}  (score {s:.2f})")


def peak_memory(device) -> dict:  # GiB: the device's peak allocation in this iteration (CUDA), the host's peak RSS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)  # (KiB)
    if device.type != "cuda":
        return {"peak_rss_gb": rss}
    peak = torch.cuda.max_memory_allocated(device) / 2**30  # both threads' tensors: trainer and sampler
    torch.cuda.reset_peak_memory_stats(device)  # so that the next iteration's peak is its own
    return {"peak_memory_gb": peak, "peak_rss_gb": rss}


def save_training(t: Training, step: int, batch: Rollout):
    """checkpoints/step-N/: config.json, policy/ (usable as --model), DCP's shards of checkpoint_state (FSDP2: not
    gathered). DCP writes .metadata last, and only a directory with one counts: a kill leaves the older ones whole."""
    import torch.distributed.checkpoint as dcp
    path = os.path.join(t.output_dir, "checkpoints", f"step-{step:08d}")
    save_policy(t, os.path.join(path, "policy"))  # (over a half-written directory of a killed run: no .metadata)
    if t.ctx.rank == 0:
        write_file(os.path.join(path, "config.json"), json.dumps(dataclasses.asdict(t.cfg), indent=2))
        for directory, _, files in os.walk(path):  # on disk before the .metadata (DCP fsyncs its own files)
            for name in files:
                with open(os.path.join(directory, name), "rb") as f:
                    os.fsync(f.fileno())
    state = checkpoint_state(t.actor, t.critic, t.optimizers, t.schedules, t.ctx, batch.sampler_rng,
                             t.shuffle_generator, step=step, first_accuracy=t.first_accuracy,
                             time_s=time.time() - t.run_start, prompts_drawn=batch.prompts_drawn, bad_steps=t.bad_steps)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # (a single process saves alone)
        dcp.save(state, checkpoint_id=path)
    if t.ctx.rank == 0:
        for old in checkpoints(t.output_dir)[:-t.cfg.keep_checkpoints]:
            os.remove(os.path.join(old, ".metadata"))  # first: a half-deleted checkpoint must not look whole
            shutil.rmtree(old)
    t.last_checkpoint = path
    print(f"checkpoint: {path}", flush=True)


class StopSignal:
    """The first SIGINT / SIGTERM ends the run after the current iteration, with a checkpoint; a second one abandons
    the iteration (KeyboardInterrupt). Handlers are installed only in the main thread, and restored on exit."""

    name = None  # the first signal's
    handlers = {}  # the handlers it replaced

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.handlers = {s: signal.signal(s, self.received) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def received(self, signum, frame):
        if self.name is not None:
            raise KeyboardInterrupt  # a second one: abandon the iteration now
        self.name = signal.Signals(signum).name
        print(f"\n{self.name}: finishing this iteration, then a checkpoint (send it again to abandon)", flush=True)

    def __exit__(self, *exc):
        for s, handler in self.handlers.items():
            signal.signal(s, handler)


def finish_training(t: Training):  # the end of a run: the policy as an HF model (output_dir/policy), the summary
    staging = os.path.join(t.output_dir, "policy.partial")  # written whole, then renamed: a crash leaves no half
    if t.ctx.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # (a crashed run's)
    save_policy(t, os.path.join(staging, "policy"))
    if t.ctx.rank == 0:
        for name in os.listdir(staging):  # policy/ (--lora-rank: and policy_adapter/): the old one aside, then gone
            final = os.path.join(t.output_dir, name)
            shutil.rmtree(final + ".old", ignore_errors=True)  # (a crash's, between the renames)
            if os.path.exists(final):
                os.replace(final, final + ".old")
            os.replace(os.path.join(staging, name), final)
            shutil.rmtree(final + ".old", ignore_errors=True)
        os.rmdir(staging)
    history = t.history
    tenth = max(1, len(history) // 10)
    first, last = (sum(r["reward_mean"] for r in rs) / max(1, len(rs)) for rs in (history[:tenth], history[-tenth:]))
    accuracies = [r["eval_accuracy"] for r in history if "eval_accuracy" in r]
    print(f"\ndone: {len(history)} iterations in {history[-1]['time_s'] if history else 0:.0f} s; reward mean "
          f"{first:.3f} (first tenth) -> {last:.3f} (last tenth)")
    if t.first_accuracy is not None and accuracies:
        print(f"held-out sampled accuracy: {t.first_accuracy:.3f} before PPO -> {accuracies[-1]:.3f} after")
    print(f"policy saved to {os.path.join(t.output_dir, 'policy')}; metrics in "
          f"{os.path.join(t.output_dir, 'metrics.jsonl')}")


# ----------------------------------------------------------------------------------------------------------------
# logging and checkpoints


class Logger:
    """metrics.jsonl and --wandb-project's wandb; on ranks > 0 (not enabled) no-ops, so the loop logs on every rank."""

    def __init__(self, cfg: Config, output_dir: str, enabled=True):
        self.file = open(os.path.join(output_dir, "metrics.jsonl") if enabled else os.devnull, "a", encoding="utf-8")
        self.wandb = None
        if cfg.wandb_project and enabled:
            import wandb  # lazy: wandb is optional
            self.wandb = wandb.init(project=cfg.wandb_project, config=dataclasses.asdict(cfg))

    def log(self, record: dict):
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])

    def close(self):
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def write_file(path: str, text: str):  # through a temporary file and a rename: a crash never leaves half a file
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def save_policy(t: Training, path: str):
    """The policy as an HF model (save_pretrained, with the tokenizer): its weights whole, without the "module." /
    "policy." prefixes of DDP and Actor; under FSDP2 gathered from the shards (a collective: every rank calls it)."""
    from torch.distributed.checkpoint import state_dict as dcp_state
    from transformers.utils import logging
    options = dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 receives them, on the CPU
    if t.run.lora:  # the adapters (the trained weights) and the merged weights, in the base's tree
        options = dataclasses.replace(options, ignore_frozen_params=True)
        with torch.no_grad():
            merged = [w.cpu() if t.ctx.rank == 0 else None for w in merged_weights(t.run.policy)]
    state = dcp_state.get_model_state_dict(t.actor, options=options)
    if t.ctx.rank == 0:
        logging.disable_progress_bar()  # no "Writing model shards" bar at every checkpoint
        model = t.run.policy
        if t.run.lora:  # policy/: the base's tree with merged weights; policy_adapter/: the adapters, for peft
            t.run.lora.save_pretrained(path + "_adapter", save_embedding_layers=False, state_dict={  # (base frozen)
                "base_model.model." + k.removeprefix("policy."): v for k, v in state.items()})
            model = t.run.reference.policy
            state = {k: w for (k, _), w in zip(model.named_parameters(), merged)}
        else:  # cloned: the trainer's parameters are views into one flat buffer (safetensors: shared memory)
            state = {k.removeprefix("policy."): v.detach().clone() for k, v in state.items()}
        model.save_pretrained(path, state_dict=state)
        t.run.tokenizer.save_pretrained(path)


def checkpoints(run_dir: str):  # the whole checkpoints of a run (those with DCP's .metadata), oldest first
    root = os.path.join(run_dir, "checkpoints")
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return [os.path.join(root, n) for n in names if n.startswith("step-") and
            os.path.isfile(os.path.join(root, n, ".metadata"))]


def trained_only():  # what a checkpoint holds of a model: the trained weights (--lora-rank: not the frozen base)
    from torch.distributed.checkpoint import state_dict as dcp_state
    return dcp_state.StateDictOptions(ignore_frozen_params=True, strict=False)  # (dcp.load checks every key it holds)


def checkpoint_state(actor, critic, optimizers, schedules, ctx: Dist, sampler_rng, shuffle_generator, loading=False,
                     **loop) -> dict:
    """What a checkpoint holds, as DCP saves it and (loading: into placeholders of the same shapes) loads it in place:
    the state dicts (sharded under FSDP2), and under this rank's own key its RNG states and loop (step, ...; DCP keeps
    one copy of a key that every rank saves, not necessarily rank 0's, and only rank 0 evaluates)."""
    from torch.distributed.checkpoint import state_dict as dcp_state
    rngs = {"sampler_rng": sampler_rng, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    state = {"schedules": [s.state_dict() for s in schedules], "shuffle_rng": shuffle_generator.get_state(),
             f"rank{ctx.rank}": {**rngs, **loop}}
    for name, model, optimizer in zip(("actor", "critic"), (actor, critic), optimizers):
        if model is not None:  # (an estimator without a critic: none)
            fresh = not optimizer.state  # no step yet: get_state_dict makes a state (AdamW's step 1), taken back here
            state[name], state[f"{name}_optimizer"] = dcp_state.get_state_dict(model, optimizer, options=trained_only())
            state[f"{name}_fresh"] = fresh
            if fresh and not loading:  # (loading: the state is the placeholder; cleared, set_state_dict would make
                optimizer.state.clear()  # another, by a step whose offload_moments overwrites what was loaded)
    if torch.cuda.is_available():  # --offload: Adam's moments come to the host without a sync (offload_moments):
        torch.cuda.synchronize()  # all there before DCP reads them, or writes into them
    return state


def load_checkpoint(path: str, actor, critic, optimizers, schedules, ctx: Dist = Dist(), device=None) -> dict:
    """In place (parameters stay views of the packed buffer), with this rank's RNGs; returns the loop state. device:
    the run's (the sampler's generator), where the trained weights are elsewhere (--fsdp --offload: the host)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dcp_state
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    world = len({k.split(".")[0] for k in saved if k.startswith("rank")})
    if world != ctx.world:
        raise SystemExit(f"--resume {path}: written by {world} ranks; resume with as many (torchrun "
                         f"--nproc_per_node), not {ctx.world}")
    device = device or next(actor.parameters()).device
    newer = {k: 0 for k in ("prompts_drawn", "bad_steps") if f"rank{ctx.rank}.{k}" in saved}  # (older: without)
    state = checkpoint_state(actor, critic, optimizers, schedules, ctx, torch.Generator(device).get_state(),
                             torch.Generator(), loading=True, step=0, first_accuracy=None, time_s=0.0, **newer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # (a single process loads alone)
        dcp.load(state, checkpoint_id=path)
    for name, model, optimizer in zip(("actor", "critic"), (actor, critic), optimizers):
        if model is not None:
            dcp_state.set_state_dict(model, optimizer, model_state_dict=state[name],
                                     optim_state_dict=state[f"{name}_optimizer"], options=trained_only())
            if state[f"{name}_fresh"]:  # saved before its first step: it starts at step 1, as the run it continues
                optimizer.state.clear()
    for schedule, saved in zip(schedules, state["schedules"]):
        schedule.load_state_dict(saved)
    mine = state[f"rank{ctx.rank}"]
    torch.set_rng_state(mine["torch_rng"])
    random.setstate(mine["python_rng"])
    if mine["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(mine["cuda_rng"])
    return {**state, **mine}


def restore_metrics(output_dir: str, step: int):
    """On resume: metrics.jsonl keeps its records up to the checkpoint's step; returns the kept iteration records."""
    path = os.path.join(output_dir, "metrics.jsonl")
    records = []
    for line in open(path, encoding="utf-8") if os.path.exists(path) else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a half-written last line
            records.append({"step": math.inf})
    dropped = sum(r["step"] > step for r in records)
    records = [r for r in records if r["step"] <= step]
    if dropped:
        print(f"resume: dropped {dropped} metrics records written after the checkpoint of step {step}")
    write_file(path, "".join(json.dumps(r) + "\n" for r in records))
    return [r for r in records if r["step"] > 0 and "skipped_update" not in r]


def nonfinite(batch: Rollout):  # the first float field of a scored batch with a NaN or inf, and in which rows
    # (behav_logprobs: a sampler whose logits went NaN still draws tokens, which sample_tokens does not check)
    names = [f.name for f in dataclasses.fields(batch) if f.type is torch.Tensor and
             getattr(batch, f.name) is not None and getattr(batch, f.name).is_floating_point()]
    B = batch.response.shape[0]
    bad = torch.stack([~torch.isfinite(getattr(batch, n).reshape(B, -1)).all(-1) for n in names]).tolist()  # one sync
    for name, flags in zip(names, bad):
        rows = [r for r, flag in enumerate(flags) if flag]
        if rows:
            return f"{name} in rows {rows[:8]}{' ...' if len(rows) > 8 else ''} of {B}"
    return None


# How reduce_record combines a logged scalar over the ranks: summed (token counts and throughputs), maxed (maxima),
# any other averaged (every rank holds as many rows, so row means average exactly; the statistics over the rows in
# the loss are global means already, global_masked_means; the few other token means average the ranks').
SUMMED_METRICS = ("response_tokens", "tokens_dropped", "gen_tokens_per_s", "train_tokens_per_s", "tokens_per_s",
                  "zero_std_groups", "env_errors")
MAXED_METRICS = ("staleness_max", "is_weight_max", "behav_prox_max_diff", "first_ratio_max_dev", "peak_memory_gb",
                 "peak_rss_gb")


def reduce_record(record: dict, world: int) -> dict:  # the logged scalars over all ranks, as declared above
    if not torch.distributed.is_initialized():
        return record
    names = [k for k, v in record.items() if isinstance(v, (int, float)) and k != "step"]
    maxed = [k for k in names if k in MAXED_METRICS]
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    for op, keys in (("sum", [k for k in names if k not in maxed]), ("max", maxed)):
        values = all_reduce(torch.tensor([float(record[k]) for k in keys], dtype=torch.float64, device=device), op)
        for k, v in zip(keys, values.tolist()):
            record[k] = v if op == "max" or k in SUMMED_METRICS else v / world
    return record


# ----------------------------------------------------------------------------------------------------------------
# distributed set-up: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; without them this is a single process. Each rank
# samples and scores its own shard of every batch with its own sampler; the actor and critic train data-parallel
# (DDP, or FSDP2 with --fsdp); whitening statistics and logged scalars are reduced over all ranks.


def init_distributed(cfg: Config) -> Dist:
    if "RANK" not in os.environ:
        return Dist()
    ctx = Dist(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    cuda = cfg.device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(ctx.local_rank)  # one device per local rank
    # --fsdp --offload: the trained models' shards, gradients and norms live on the host: their collectives take gloo
    torch.distributed.init_process_group(("cpu:gloo,cuda:nccl" if cfg.fsdp and cfg.offload else "nccl") if cuda else
                                         "gloo")
    if ctx.rank > 0:  # rank 0 alone prints; errors (stderr) still come from every rank
        sys.stdout = open(os.devnull, "w")
    return ctx


def all_reduce(t, op="sum", group=None):  # t reduced over all ranks, in place; the identity in a single process
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, getattr(torch.distributed.ReduceOp, op.upper()), group)
    return t


def gather_objects(obj, group=None) -> list:  # every rank's obj, in rank order; [obj] in a single process
    if not torch.distributed.is_initialized():
        return [obj]
    objects = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(objects, obj, group=group)
    return objects


def any_rank(flag: bool, device) -> bool:  # a decision every rank must take together (skip an update, stop)
    return bool(all_reduce(torch.tensor([float(flag)], device=device), "max"))


# ----------------------------------------------------------------------------------------------------------------
# benchmarks


def bench_overlap(cfg: Config, output_dir: str):
    """--bench-overlap: the same run at --max-staleness 0, 1, 2: tokens/s, trainer idle, sync time, reward by a time."""
    results = {}
    for staleness in (0, 1, 2):
        c = dataclasses.replace(cfg, max_staleness=staleness, bench_overlap=False, sample_every=0,
                                output_dir=os.path.join(output_dir, f"staleness{staleness}"))
        os.makedirs(c.output_dir, exist_ok=True)
        run = setup(c)
        run.task = Task()  # no evaluations inside the timed runs
        results[staleness] = train(c, run, c.output_dir)
    common = min(h[-1]["time_s"] for h in results.values())  # the wall time every run reached
    base = sum(r["response_tokens"] for r in results[0]) / results[0][-1]["time_s"]
    print(f"\n{'staleness':>9} | {'tokens/s':>9} | {'vs 0':>5} | {'trainer idle':>12} | {'sync ms':>7} | "
          f"reward at {common:.0f} s")
    for staleness, h in results.items():
        tokens_per_s = sum(r["response_tokens"] for r in h) / h[-1]["time_s"]
        idle = sum(r["trainer_idle_frac"] * r["iter_s"] for r in h) / sum(r["iter_s"] for r in h)
        sync_ms = sum(r["weight_sync_ms"] for r in h) / len(h)
        reached = [r["reward_mean"] for r in h if r["time_s"] <= common][-5:]
        print(f"{staleness:>9} | {tokens_per_s:>9.0f} | {tokens_per_s / base:>4.2f}x | {idle:>12.2f} | "
              f"{sync_ms:>7.2f} | {sum(reached) / len(reached):.3f}")


def bench_rollout(cfg: Config):
    """--bench-rollout: our sampler's tokens/s (plain, static cache, shared prefill, compiled) vs HF generate."""
    run = setup(dataclasses.replace(cfg, demo_warmup_steps=0))  # speed does not depend on the weights
    B, n, pad = cfg.batch_size, cfg.samples_per_prompt, run.tokenizer.pad_token_id
    # sized and sampled as train() does: rows in groups of n with one prompt; no stop id: --response-length tokens each
    ids, mask = left_pad([run.prompt_ids[i // n % len(run.prompt_ids)] for i in range(B)], pad, run.device)
    args = dict(sampling_args(cfg, pad, [], run.vocab), generator=torch.Generator(run.device))
    model = run.reference.policy if run.lora else run.policy  # (--lora-rank: the base, which its zero B A leave as is)
    kernels.bench_sampler(sampler_copy(model, trained_dtype(cfg))[0], ids, mask, functools.partial(generate, **args),
                          PlainDecoder, max(map(len, run.prompt_ids)) + cfg.response_length, n, cfg.compile_sampler,
                          temperature=cfg.temperature, max_new_tokens=cfg.response_length, pad_token_id=pad,
                          eos_token_id=run.tokenizer.eos_token_id)


# ----------------------------------------------------------------------------------------------------------------
# the command line and main


# flags a resumed run may change (micro-batching: the loss is the same however a minibatch is split, and a packing
# check that fell back wrote its padded micro-batches into the config); every other flag must match the checkpoint's
RUN_ONLY = ("resume", "output_dir", "save_every", "keep_checkpoints", "max_bad_steps", "wandb_project",
            "sample_every", "fsdp", "compile_sampler", "micro_batch_size", "micro_batch_tokens")
# the flags that take one of a few words, and the numeric flags' lower bounds (0: the flag can turn a feature off)
CHOICES = {"kl_estimator": ("k1", "k2", "k3"), "kl_in": ("reward", "loss"),
           "advantage": ADVANTAGES, "policy_loss": POLICY_LOSSES,  # (the tables, as they are)
           "scale_rewards": ("group", "batch", "none"),
           "loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
           "dtype": ("float32", "bfloat16")}
LOWER_BOUNDS = {"steps": 1, "batch_size": 1, "response_length": 1, "ppo_epochs": 1, "minibatches": 1, "eval_every": 1,
                "samples_per_prompt": 1, "keep_checkpoints": 1, "max_bad_steps": 1, "is_cap": 1, "max_staleness": 0,
                "clip_range_high": 0, "save_every": 0, "micro_batch_tokens": 0, "max_turns": 1, "env_latency": 0,
                "dynamic_sampling": 0, "lora_rank": 0, "max_prompt_length": 1, "max_grad_norm": 0,
                "micro_batch_size": 0, "kl_coef": 0, "weight_decay": 0, "value_clip_range": 0}


def parse_config(argv=None) -> Config:
    """The flags given on the command line over the presets they choose (make_config); --resume: over the checkpoint's
    config instead, and a flag that would change the run is refused."""
    epilog = ("presets, applied before the flags given (a flag given wins): --model's; else the multi-turn demo's for "
              "--env demo, the critic-free demo's for an --advantage without a critic, the grouped demo's for one over "
              "groups\n" +
              "\n".join(f"  {name}: {as_flags(values)}" for name, values in PRESETS.items()))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     argument_default=argparse.SUPPRESS)  # (only the flags given are parsed)
    for f in dataclasses.fields(Config):
        kind = {"action": argparse.BooleanOptionalAction} if f.type is bool else {"type": f.type}
        bare = {"nargs": "?", "const": "latest"} if f.name == "resume" else {}  # bare --resume: --output-dir's newest
        shown = [show(f.default)] + [f"{name}: {show(values[f.name])}" for name, values in PRESETS.items()
                                     if f.name in values]
        parser.add_argument("--" + f.name.replace("_", "-"), help=f"{f.metadata['help']} (default: "
                            f"{'; '.join(shown)})", **kind, **bare)
    given = vars(parser.parse_args(argv))
    try:
        if "resume" in given:  # the checkpoint's config is the run's, so `--resume PATH` alone continues it
            path = given.get("output_dir", "") if given["resume"] == "latest" else given["resume"]  # a checkpoint/run
            if not path:
                raise ValueError("--resume needs --output-dir DIR (the run to continue), or --resume PATH")
            path = os.path.abspath(path)  # (a trailing slash or a relative path must not move the run's directory)
            found = [path] if os.path.isfile(os.path.join(path, ".metadata")) else checkpoints(path)
            if not found:
                raise ValueError(f"--resume: no whole checkpoint in {path} (looked for "
                                 f"{path}/checkpoints/step-*/.metadata)")
            checkpoint = found[-1]
            names = {f.name for f in dataclasses.fields(Config)}
            with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as f:
                saved = {k: v for k, v in json.load(f).items() if k in names}
            if "task" not in saved and saved.get("prompts") and not saved.get("model"):  # written before --task: the
                saved["demo_warmup_steps"] = 0  # demo model with --prompts was not warmed up then
            saved = dataclasses.asdict(make_config(**saved))  # a flag newer than the checkpoint: as that run had it
            if {"micro_batch_size", "micro_batch_tokens"} & given.keys():  # one of the two: the other off
                saved.update(micro_batch_size=0, micro_batch_tokens=0)
            cfg = Config(**{**saved, **given})
            changed = [k for k in given if k not in RUN_ONLY and getattr(cfg, k) != saved[k]]
            if changed:
                raise ValueError("--resume: " + ", ".join(f"--{k.replace('_', '-')} {getattr(cfg, k)} differs from "
                                 f"the checkpoint's {saved[k]}" for k in changed) + "; drop the flag or start a new "
                                 "run")
            cfg.resume, cfg.output_dir = checkpoint, os.path.dirname(os.path.dirname(checkpoint))
            if given.get("output_dir") and os.path.realpath(given["output_dir"]) != os.path.realpath(cfg.output_dir):
                raise ValueError(f"--resume continues its run in {cfg.output_dir}, not --output-dir "
                                 f"{given['output_dir']}; for a new run from its weights: --model {checkpoint}/policy")
        else:
            cfg = make_config(**given)
            for name, values in presets(given):  # what the run takes from a preset
                taken = {k: v for k, v in values.items() if k not in given}
                if taken:
                    print(f"preset {name}: {as_flags(taken)}")
        check_config(cfg)
    except (ValueError, KeyError) as e:
        parser.exit(2, f"ppo_tokens.py: error: {e}\n")
    return cfg


def as_flags(values: dict) -> str:  # {"kl_coef": 0.1, "task": "", "bf16": True} -> "--kl-coef 0.1, --task '', --bf16"
    return ", ".join(f"--{'' if v else 'no-'}{k.replace('_', '-')}" if isinstance(v, bool) else
                     f"--{k.replace('_', '-')} {show(v)}" for k, v in values.items())


def show(value) -> str:  # a flag's value as the command line takes it
    return repr(value) if value == "" else str(value)


def check_config(cfg: Config):
    """Check every value and size once, with errors that name the flags to change."""
    world = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun --batch-size is global; each rank takes 1/world
    ranks = f" x {world} ranks (torchrun's WORLD_SIZE)" if world > 1 else ""
    minibatch_size = cfg.batch_size // max(1, cfg.minibatches * world)  # per rank
    checks = [(getattr(cfg, n) in words, f"--{n.replace('_', '-')} must be {', '.join(list(words)[:-1])} or "
               f"{list(words)[-1]} (got {getattr(cfg, n)!r})") for n, words in CHOICES.items()]
    checks += [(getattr(cfg, n) >= low, f"--{n.replace('_', '-')} must be >= {low} (got {getattr(cfg, n)})")
               for n, low in LOWER_BOUNDS.items()]
    checks += [(getattr(cfg, n) > 0, f"--{n.replace('_', '-')} must be > 0 (got {getattr(cfg, n)})")
               for n in ("lr", "critic_lr", "clip_range", "adam_eps")]
    checks += [(0 <= getattr(cfg, n) <= 1, f"--{n} must be in 0..1 (got {getattr(cfg, n)})") for n in ("gamma", "lam")]
    checks += [(cfg.temperature > 0, f"--temperature must be > 0 (got {cfg.temperature}): PPO's ratio needs a "
                "sampling distribution; for near-greedy use e.g. 0.05"),
               (not ADVANTAGES.get(cfg.advantage, ADVANTAGES["gae"]).groups or cfg.samples_per_prompt >= 2,
                f"--advantage {cfg.advantage} compares the completions of a prompt: --samples-per-prompt must be >= 2 "
                f"(got {cfg.samples_per_prompt}); e.g. 8"),
               (not cfg.dynamic_sampling or cfg.samples_per_prompt >= 2,
                f"--dynamic-sampling keeps groups whose scores differ: --samples-per-prompt must be >= 2 (got "
                f"{cfg.samples_per_prompt})"),
               (cfg.kl_in == "reward" or cfg.kl_estimator != "k1",
                "--kl-in loss needs --kl-estimator k2 or k3: k1's expected gradient is 0 (E[grad log pi] = 0)"),
               (cfg.samples_per_prompt < 1 or cfg.batch_size % (cfg.samples_per_prompt * world) == 0,
                f"--batch-size {cfg.batch_size} must be divisible by --samples-per-prompt {cfg.samples_per_prompt}"
                f"{ranks} (each rank holds whole groups)"),
               (cfg.minibatches < 1 or cfg.batch_size % (cfg.minibatches * world) == 0,
                f"--batch-size {cfg.batch_size} must be divisible by --minibatches {cfg.minibatches}{ranks}"),
               (not cfg.micro_batch_size or minibatch_size % cfg.micro_batch_size == 0,
                f"the minibatch size per rank (--batch-size {cfg.batch_size} / --minibatches {cfg.minibatches}{ranks} "
                f"= {minibatch_size}) must be divisible by --micro-batch-size {cfg.micro_batch_size}"),
               (not (cfg.micro_batch_tokens and cfg.micro_batch_size),
                "give --micro-batch-size (rows) or --micro-batch-tokens (a token budget), not both"),
               (not (cfg.reward and cfg.reward_model), "give either --reward or --reward-model, not both"),
               (not cfg.lora_rank or importlib.util.find_spec("peft"), "--lora-rank needs peft: pip install peft"),
               (cfg.lora_alpha > 0, f"--lora-alpha must be > 0 (got {cfg.lora_alpha}): the adapters' scale is "
                "alpha / rank"),
               (not (cfg.env and (cfg.reward or cfg.reward_model)),
                "--env gives the rewards (each step's): drop --reward / --reward-model"),
               (cfg.task or cfg.reward or cfg.reward_model or cfg.env or cfg.bench_rollout,  # (the benchmark: none)
                "--model needs a reward: pass --reward module:function, --reward-model DIR, --env or a --task"),
               (not cfg.model or cfg.prompts or cfg.task, "--model needs --prompts FILE.jsonl, or a --task"),
               (0 < cfg.top_p <= 1 and cfg.top_k >= 0, "--top-p must be in (0, 1] and --top-k >= 0"),
               (not cfg.prompts or os.path.isfile(cfg.prompts), f"--prompts {cfg.prompts}: no such file"),
               (not cfg.reward_model or os.path.isdir(cfg.reward_model),
                f"--reward-model {cfg.reward_model}: no such directory"),
               (cfg.static_cache or not cfg.compile_sampler,
                "--compile-sampler needs the static cache: drop --no-static-cache"),
               (not (cfg.bench_overlap or cfg.bench_rollout) or world == 1,
                "--bench-overlap and --bench-rollout run in one process; start them with python, not torchrun"),
               (1 <= cfg.eval_size <= 5000, f"--eval-size must be in 1..5000 (got {cfg.eval_size})"),
               (world == 1 or ":" not in cfg.device, f"--device {cfg.device}: under torchrun each rank uses "
                "cuda:LOCAL_RANK; pass --device cuda (or set CUDA_VISIBLE_DEVICES)"),
               (not cfg.device.startswith("cuda") or torch.cuda.is_available(),
                f"--device {cfg.device}: CUDA is not available here; use --device cpu")]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def main(argv=None):
    cfg = parse_config(argv)
    ctx = init_distributed(cfg)
    try:
        if cfg.bench_rollout:  # (writes nothing)
            return bench_rollout(cfg)
        # rank 0 decides (and dates) the output directory; every rank gets its answer
        output_dir = cfg.output_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
        error = None
        if ctx.rank == 0 and not cfg.resume and (os.path.exists(os.path.join(output_dir, "metrics.jsonl")) or
                                                 checkpoints(output_dir)):
            error = (f"--output-dir {output_dir} already holds a run (metrics.jsonl, checkpoints); continue it with "
                     "--resume, or choose another directory")
        if torch.distributed.is_initialized():
            shared = [output_dir, error]
            torch.distributed.broadcast_object_list(shared, src=0)
            output_dir, error = shared
        if error:
            raise SystemExit(error)
        os.makedirs(output_dir, exist_ok=True)
        if cfg.bench_overlap:
            return bench_overlap(cfg, output_dir)
        train(cfg, setup(cfg, ctx), output_dir, ctx=ctx)
    finally:
        if torch.distributed.is_initialized():  # free DDP/FSDP wrappers held in reference cycles first: a process
            gc.collect()  # group they keep alive until interpreter shutdown can abort the process there (gloo)
            torch.distributed.destroy_process_group()


# ================================================================================================================
# THE BUILT-IN DEMO, a task like a user's: a tiny Llama learns a+b (a, b in 0..99). It reaches the run only through
# the interfaces a user has: a Task (prompts, reward, model, warm-up, held-out evaluation), --reward's contract
# (addition_reward) and --env's (AdditionRetry, the multi-turn demo); its defaults are the presets beside Config.
# ================================================================================================================


def addition_task(cfg: Config) -> Task:
    """The demo: all (a, b) in 0..99 x 0..99, split into training and held-out pairs once, the same for every seed.
    The multi-turn demo's game takes the pairs whose sum is below 90: a neighbour 10 away then keeps two digits, and
    the digit the hint decides (the tens) is always the answer's first, right after the hint. With three-digit sums
    it was the second for half the game, which PPO learnt late or never depending on the CPU's rounding (README 21)."""
    pairs = [divmod(i, 100) for i in torch.randperm(10_000, generator=torch.Generator().manual_seed(1234)).tolist()]
    pairs = [(a, b) for a, b in pairs if a + b < 90] if cfg.env in ENVIRONMENTS else pairs
    train_pairs, held_out = pairs[cfg.eval_size:], pairs[:cfg.eval_size]
    if len(train_pairs) < 256:  # (the warm-up's accuracy check samples 256)
        raise SystemExit(f"--eval-size {cfg.eval_size} leaves {len(train_pairs)} of this demo's {len(pairs)} sums to "
                         f"train on; at most {len(pairs) - 256}")
    env = load_env(cfg.env) if cfg.env else None  # (the multi-turn demo evaluates whole episodes)
    return Task(prompts=[addition_prompt(a, b) for a, b in train_pairs], reward=addition_reward, model=demo_model,
                warmup=functools.partial(demo_warmup, train_pairs=train_pairs),
                evaluate=functools.partial(evaluate, texts=[addition_prompt(a, b) for a, b in held_out],
                                           seed=cfg.seed + 2, env=env))


def demo_model(cfg: Config):  # -> (the character tokenizer, a ~0.6M-parameter Llama)
    tokenizer = build_demo_tokenizer(hints=cfg.env in ENVIRONMENTS)
    return tokenizer, build_demo_policy(tokenizer, cfg.seed, cfg.demo_hidden, cfg.demo_layers)


def addition_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def addition_reward(prompts, completions, ended, **facts):
    """The demo's verifiable reward, through the --reward interface: 1 for the exact sum followed by EOS, else 0."""
    pairs = (prompt.rstrip("=").split("+") for prompt in prompts)
    return [float(e and c.strip() == str(int(a) + int(b))) for (a, b), c, e in zip(pairs, completions, ended)]


def build_demo_tokenizer(hints=False):  # the addition demo's: one token per character (hints: the env's < and >)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *"0123456789+=", *"<>" * hints])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")


def build_demo_policy(tokenizer, seed: int, hidden=128, layers=3):  # ~0.6M parameters (README: the demo)
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=hidden * 43 // 16, max_position_embeddings=64,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


class AdditionRetry:
    """The multi-turn demo's game: the number is a+b or its neighbour 10 below or above (hidden, of the episode's seed).
    A wrong guess gets the question again and a hint, '<' (too low) or '>' (too high), and another try (--max-turns);
    hint=False ('demo-control'): '=' instead of the hint. Reward 1 for the number then EOS."""

    def __init__(self, hint=True):
        self.hint = hint

    def reset(self, prompt: str, seed: int = None):  # -> (observation: the first user message, info)
        a, b = prompt.rstrip("=").split("+")
        self.question, self.answer = prompt, neighbour(int(a) + int(b), random.Random(seed).choice((-10, 0, 10)))
        return prompt, {}

    def step(self, action: str, ended: bool = True):  # -> (observation, reward, terminated, truncated, info)
        if ended and action.strip() == str(self.answer):
            return "", 1.0, True, False, {}
        return self.question + retry_hint(action, self.answer, self.hint), 0.0, False, False, {}


def neighbour(n: int, d: int) -> int:  # n + d, or n - d where n + d is negative or has another number of digits
    return n + d if n + d >= 0 and (n < 10 or len(str(n + d)) == len(str(n))) else n - d


def retry_hint(guess: str, answer: int, hint=True) -> str:
    return ("<" if (int(guess) if guess.strip().isdigit() else -1) < answer else ">") if hint else "="


ENVIRONMENTS = {"demo": AdditionRetry, "demo-control": functools.partial(AdditionRetry, hint=False)}


@torch.no_grad()
def evaluate(policy, tokenizer, cfg: Config, texts, seed: int, env=None, chunk=500) -> dict:
    """The demo's held-out scores on `texts` (Task.evaluate): sampled accuracy (as training samples), re-seeded, so
    that successive evaluations differ only by the weights. env (the multi-turn demo): greedy success within
    --max-turns, on the first turn, and on the second try after a miss."""
    device = policy.device
    prompt_texts, prompt_ids = texts, format_prompts(tokenizer, texts, cfg.chat_template, cfg.max_prompt_length)
    generator = torch.Generator(device).manual_seed(seed)
    args = sampling_args(cfg, tokenizer.pad_token_id, tokenizer.eos_token_id)
    if env is not None:  # greedy: the policy's best answer each turn, so that the second try shows what it learned
        args["top_k"] = 1
    first_success = []  # per prompt: the turn of its first reward (1, 2, ...), 0 for none
    for start in range(0, len(prompt_ids), chunk):
        texts = prompt_texts[start:start + chunk]
        if env is None:
            ids, mask = left_pad(prompt_ids[start:start + chunk], tokenizer.pad_token_id, device)
            batch = generate(policy, ids, mask, **args, generator=generator)
            first_success += addition_reward(texts, decode_completions(tokenizer, batch), batch.ended.tolist())
        else:
            seeds = [seed * 1_000_003 + start + k for k in range(len(texts))]  # (the same tasks every evaluation)
            batch = run_episodes(policy, [env() for _ in texts], texts, seeds, tokenizer, cfg, None, **args,
                                 generator=generator)
            first_success += [next((k + 1 for k, x in enumerate(turns) if x > 0), 0)
                              for turns in batch.episodes["rewards"]]
    share = [sum(0 < k <= turn for k in first_success) / len(first_success) for turn in (1, 2, cfg.max_turns)]
    if env is None:
        return {"eval_accuracy": share[0]}
    return {"eval_accuracy": share[2], "eval_turn1": share[0], "eval_second_try": (share[1] - share[0]) / max(
        1e-9, 1 - share[0])}


def demo_warmup(policy, tokenizer, cfg: Config, train_pairs):
    """Supervised warm-up, so that PPO starts from a policy that is sometimes right. A fixed number of steps: a stop
    at an accuracy threshold moved with rounding, as does the loss's drop (CPU: 300-500 steps, H200: 500+). Cached."""
    retry = cfg.env in ENVIRONMENTS  # the multi-turn demo: its second half also shows the game's format
    key = json.dumps([policy.config.to_json_string(), sorted(tokenizer.get_vocab().items()), cfg.seed,
                      cfg.demo_warmup_lr, cfg.demo_warmup_steps, train_pairs,  # (another --eval-size: other pairs)
                      *map(inspect.getsource, (demo_warmup, addition_prompt, retry_hint, neighbour)),  # (an edit: anew)
                      *([cfg.env] if retry else [])])
    name = f"demo-warmup-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    path = os.path.join(os.path.expanduser(cfg.demo_cache), name)
    if os.path.exists(path):
        saved = torch.load(path, map_location=policy.device)
        policy.load_state_dict(saved["state_dict"])
        print(f"warm-up: loaded {path} ({saved['steps']} steps, sampled train accuracy {saved['accuracy']:.2f})")
        return
    if cfg.demo_warmup_steps == 0:
        return
    t0 = time.time()
    # beta2 0.95, as in LLM pre-training: with 0.999 the accuracy's jump came anywhere from ~250 to 700+ steps
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.demo_warmup_lr, betas=(0.9, 0.95), weight_decay=0.0)
    # a 50-step LR warm-up; multi-turn: then down to 5% over the second half (surer sums: seed 1 ends 0.98, not 0.90)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50, 2.0 * (1 - s / cfg.demo_warmup_steps) + 0.05 if retry else 1.0))
    rng = random.Random(cfg.seed)
    all_ids = format_prompts(tokenizer, [addition_prompt(a, b) for a, b in train_pairs], False, 64)
    answers = [tokenizer(str(a + b), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
               for a, b in train_pairs]
    for step in range(1, cfg.demo_warmup_steps + 1):
        rows = rng.sample(range(len(train_pairs)), 128)
        ids, mask = left_pad([all_ids[i] for i in rows], tokenizer.pad_token_id, policy.device)
        seqs, loss = [answers[i] for i in rows], None
        mixed = retry and step > cfg.demo_warmup_steps // 2  # the second half: the conversation's format too
        if mixed:  # every other row a second try after a miss W (1 or 20 off): W<eos>, a+b=, the hint (W against the
            # answer, as the game's), then the answer: the sum or, for a fifth, a neighbour on either side. Left to PPO:
            seqs, loss = [], []  # after a miss of the sum itself, the answer is the neighbour the hint points to
            for k, i in enumerate(rows):
                total = sum(train_pairs[i])
                miss, target = total + rng.choice((-20, -1, 1, 20)), total
                miss = miss if miss >= 0 else 2 * total - miss
                if rng.random() < 0.2:
                    target = neighbour(total, rng.choice((-10, 10)))
                hint = addition_prompt(*train_pairs[i]) + retry_hint(str(miss), target, cfg.env == "demo")
                context = [] if k % 2 == 0 else tokenizer(f"{miss}", add_special_tokens=False)["input_ids"] + [
                    tokenizer.eos_token_id] + tokenizer(hint, add_special_tokens=False)["input_ids"]
                answer = answers[i] if k % 2 == 0 else tokenizer(str(target), add_special_tokens=False)[
                    "input_ids"] + [tokenizer.eos_token_id]
                seqs.append(context + answer)
                loss.append([0] * len(context) + [1] * len(answer))  # the loss on the answer and its EOS only
        response = tokenizer.pad({"input_ids": seqs}, padding_side="right", return_tensors="pt").to(policy.device)
        batch = Rollout(ids, mask, response["input_ids"], response["attention_mask"], None, None, None)
        if mixed:
            batch.context_mask = batch.response_mask
            batch.response_mask = torch.tensor([x + [0] * (batch.response.shape[1] - len(x)) for x in loss],
                                               device=policy.device)
        logprobs, _ = sequence_logprobs(policy, *full_sequence(batch), batch.response, batch.response_mask, 1.0,
                                        full_logits=cfg.full_logits)
        loss = -masked_mean(logprobs, batch.response_mask)  # cross-entropy on the answer and its EOS only
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0:
            print(f"\rwarm-up step {step}/{cfg.demo_warmup_steps}: loss {loss.item():.3f}", end="", flush=True)
    check = random.Random(cfg.seed + 1).sample(range(len(train_pairs)), 256)  # for the log only
    texts = [addition_prompt(*train_pairs[i]) for i in check]
    accuracy = evaluate(policy, tokenizer, cfg, texts, step)["eval_accuracy"]
    print(f"\nwarm-up: {step} steps in {time.time() - t0:.1f} s, sampled train accuracy {accuracy:.2f}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"state_dict": policy.state_dict(), "steps": step, "accuracy": accuracy}, path + ".tmp")
    os.replace(path + ".tmp", path)  # a killed run never leaves half a cache entry


TASKS = {"demo": addition_task}  # --task's names


if __name__ == "__main__":
    main()
