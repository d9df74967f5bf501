"""ppo_tokens: PPO for language models (RLHF) in one hackable file.

What it does, top to bottom: a policy (any Hugging Face causal LM) samples completions for a batch of prompts with
its own KV-cache sampling loop; a frozen reference model, a critic (value head on a causal-LM backbone) and a reward
(a reward model, a Python function, or the demo's rule) score them; per-token rewards are the score on the last real
token minus kl_coef * KL(policy || reference) on every token; GAE turns them into advantages; and the clipped PPO
objective updates the policy and the critic over a few epochs of minibatches. It follows "The N+ Implementation
Details of RLHF with PPO" (Huang et al., 2024) and TRL's PPOTrainer where they agree, and says so where it differs.

Deliberately left out (for now): the overlapped generate/train loop (--max-staleness > 0), multi-GPU and
checkpoint/resume; one process, one device, synchronous PPO.

Run it:
    python ppo_tokens.py                                    # built-in CPU demo: a 0.6M-parameter Llama learns addition
    python ppo_tokens.py --model Qwen/Qwen2.5-0.5B-Instruct --prompts prompts.jsonl \\
        --reward-model ./my_rm --response-length 256 --batch-size 64 --device cuda --dtype bfloat16
    python ppo_tokens.py --model ./my_policy --prompts prompts.jsonl --reward my_rewards:score
    python ppo_tokens.py --help                             # every flag with its comment
The numbers quoted in README.md come from the commands listed there, on the machines named there.
"""
import argparse, copy, dataclasses, hashlib, importlib, inspect, json, math, os, random, shutil, sys, time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import linear_token_logprobs, token_logprobs

# ----------------------------------------------------------------------------------------------------------------
# config


def arg(default, help):  # a Config field whose help text is its comment; the CLI is generated from these
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # what to train
    model: str = arg("", "HF causal-LM directory or hub name; empty = the built-in demo (a tiny Llama learns addition)")
    reward_model: str = arg("", "AutoModelForSequenceClassification (num_labels=1) directory: score = its output")
    reward: str = arg("", "'module:function' with (prompts, completions) -> list[float]; the demo uses exact match")
    prompts: str = arg("", "JSONL file, one object per line with a 'prompt' field; empty = the demo's prompts")
    chat_template: bool = arg(True, "wrap each prompt in the tokenizer's chat template when it has one")
    max_prompt_length: int = arg(512, "prompts longer than this many tokens keep their last tokens (counted warning)")
    # rollout
    steps: int = arg(400, "PPO iterations: one rollout batch and its update each")
    batch_size: int = arg(256, "rollouts (prompt + one sampled completion) per iteration")
    response_length: int = arg(0, "max new tokens per completion; 0 = 4 for the demo, 128 otherwise")
    temperature: float = arg(1.0, "sampling temperature; scoring divides the logits by the same value")
    top_k: int = arg(0, "sample from the k most likely tokens only (0 = off); log-probs renormalise over that set")
    top_p: float = arg(1.0, "nucleus sampling threshold (1 = off); keeps at most --top-k ids, 64 when --top-k is 0")
    # PPO
    ppo_epochs: int = arg(2, "passes over each rollout batch")
    minibatches: int = arg(4, "optimizer steps per epoch; --batch-size must divide by it")
    micro_batch_size: int = arg(0, "rows per forward/backward, gradients accumulate; 0 = the whole minibatch")
    lr: float = arg(5e-4, "policy learning rate (AdamW); the demo's value, use ~1e-6 for real models")
    critic_lr: float = arg(1e-3, "critic learning rate (AdamW); use ~1e-5 for real models")
    lr_decay: bool = arg(True, "decay both learning rates linearly to 0 over --steps")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    adam_eps: float = arg(1e-5, "AdamW epsilon (1e-5 as in the N+ details, not PyTorch's 1e-8)")
    max_grad_norm: float = arg(1.0, "gradient-norm clip, per model")
    clip_range: float = arg(0.2, "PPO ratio clip epsilon")
    value_clip_range: float = arg(0.2, "value-prediction clip around the rollout's values")
    entropy_coef: float = arg(0.0, "entropy bonus in the policy loss (0 = only logged)")
    kl_coef: float = arg(0.02, "weight of the per-token KL(policy || reference) penalty in the reward")
    kl_estimator: str = arg("k1", "per-token KL estimator in the reward: k1 = logp - ref, k3 = e^(ref-logp) - (ref-logp) - 1")
    gamma: float = arg(1.0, "GAE discount")
    lam: float = arg(0.95, "GAE lambda")
    whiten_scores: bool = arg(False, "whiten the sequence scores over the batch before adding them to the rewards")
    missing_eos_penalty: float = arg(0.0, "subtracted from the score of completions that hit --response-length without EOS")
    max_staleness: int = arg(0, "rollout batches the sampler may run ahead of the trainer; only 0 (synchronous) so far")
    full_logits: bool = arg(False, "compute log-probs from full [tokens, vocab] logits instead of the fused lm_head path")
    # the built-in demo
    demo_warmup_max_steps: int = arg(1500, "cap on supervised warm-up steps before PPO (0 = no warm-up)")
    demo_warmup_target: float = arg(0.20, "warm-up stops once sampled accuracy on 256 training prompts reaches this")
    demo_warmup_lr: float = arg(3e-3, "warm-up learning rate (AdamW, 50-step linear warm-up, grad clip 1)")
    demo_cache: str = arg("~/.cache/ppo_tokens", "where the warmed-up demo checkpoint is cached between runs")
    eval_every: int = arg(25, "held-out evaluation every this many iterations (demo only; also before and after)")
    eval_size: int = arg(1000, "held-out prompts per evaluation (demo only)")
    sample_every: int = arg(50, "print a few sample completions every this many iterations (0 = never)")
    # run
    seed: int = arg(1, "seeds model init, sampling, data order and minibatch shuffling")
    device: str = arg("auto", "'auto' (cuda if available), 'cpu', 'cuda' or 'cuda:N'")
    dtype: str = arg("float32", "parameter dtype of all models: float32 or bfloat16")
    output_dir: str = arg("", "where config.json, metrics.jsonl and policy/ go; empty = runs/<date-time>")
    wandb_project: str = arg("", "log to this Weights & Biases project (off when empty; wandb imported only then)")


def parse_config(argv=None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            parser.add_argument(flag, default=f.default, action=argparse.BooleanOptionalAction, help=f.metadata["help"])
        else:
            parser.add_argument(flag, default=f.default, type=type(f.default), help=f.metadata["help"])
    cfg = Config(**vars(parser.parse_args(argv)))
    try:
        check_config(cfg)
    except ValueError as e:
        parser.exit(2, f"ppo_tokens.py: error: {e}\n")
    return cfg


def check_config(cfg: Config):
    """Resolve the derived values and check every size once, with errors that name the flags to change."""
    if cfg.response_length == 0:
        cfg.response_length = 4 if is_demo(cfg) else 128
    if cfg.max_staleness != 0:
        raise ValueError("--max-staleness must be 0 for now: the overlapped generate/train loop has not landed yet")
    if cfg.temperature <= 0:
        raise ValueError(f"--temperature must be > 0 (got {cfg.temperature}); for near-greedy sampling use e.g. 0.05")
    if cfg.kl_estimator not in ("k1", "k3"):
        raise ValueError(f"--kl-estimator must be k1 or k3 (got {cfg.kl_estimator!r})")
    if cfg.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype must be float32 or bfloat16 (got {cfg.dtype!r})")
    if cfg.reward and cfg.reward_model:
        raise ValueError("give either --reward or --reward-model, not both")
    if not is_demo(cfg) and not (cfg.reward or cfg.reward_model):
        raise ValueError("--model/--prompts need a reward: pass --reward module:function or --reward-model DIR")
    if cfg.model and not cfg.prompts:
        raise ValueError("--model needs --prompts FILE.jsonl (the demo prompts only fit the demo tokenizer)")
    for name in ("steps", "batch_size", "response_length", "ppo_epochs", "minibatches"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(cfg, name)})")
    if cfg.batch_size % cfg.minibatches:
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by --minibatches {cfg.minibatches}")
    minibatch_size = cfg.batch_size // cfg.minibatches
    if cfg.micro_batch_size and minibatch_size % cfg.micro_batch_size:
        raise ValueError(f"the minibatch size (--batch-size {cfg.batch_size} / --minibatches {cfg.minibatches} = "
                         f"{minibatch_size}) must be divisible by --micro-batch-size {cfg.micro_batch_size}")
    if not 0 < cfg.top_p <= 1 or cfg.top_k < 0:
        raise ValueError("--top-p must be in (0, 1] and --top-k >= 0")


def is_demo(cfg: Config) -> bool:
    return not cfg.model and not cfg.prompts


# ----------------------------------------------------------------------------------------------------------------
# models and tokenizer


def build_demo_tokenizer():
    """Character-level tokenizer for the addition demo, as a PreTrainedTokenizerFast (so it is any HF tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *"0123456789+="])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")


def build_demo_policy(tokenizer, seed: int):
    """~0.6M-parameter Llama (hidden 128, 3 layers, 4 heads), the size calibrated in shared/DEMO-CALIBRATION.md."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=344, max_position_embeddings=64,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def ensure_pad_token(tokenizer, model):
    """Give the tokenizer a pad token distinct from EOS. Masks never come from `ids == pad` here, but a pad equal to
    EOS is how other code ends up masking the real EOS token out of the loss, so we refuse to share the id."""
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return
    tokenizer.add_special_tokens({"pad_token": "<|ppo_tokens_pad|>"})
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:  # many vocabularies have spare rows already
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id


def disable_dropout(model: nn.Module):
    """Dropout makes the scoring pass and the training pass see different networks, so the PPO ratio is not 1 on the
    first minibatch (N+ detail). Zero every dropout module and every *dropout* probability in the config."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name in ("attention_dropout", "dropout", "attn_dropout"):  # HF attention layers read a float attribute
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)
    config = getattr(model, "config", None)
    for key, value in (vars(config).items() if config is not None else ()):
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)


def backbone_of(model):  # LlamaForCausalLM.model, Qwen2ForSequenceClassification.model, GPT2*.transformer, ...
    return getattr(model, model.base_model_prefix)


class ScalarHeadModel(nn.Module):
    """A causal-LM backbone with a linear head to one scalar per token: the critic (value of the state before each
    token) and the reward model (score at the last real token) are both this."""

    def __init__(self, backbone: nn.Module, head: nn.Linear):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, input_ids, attention_mask, position_ids):  # -> (B, L) float32
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids).last_hidden_state
        return self.head(hidden).squeeze(-1).float()


def load_reward_model(path: str, device, dtype):
    """Returns (ScalarHeadModel, its tokenizer) from an AutoModelForSequenceClassification directory."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    if model.config.num_labels != 1:
        raise SystemExit(f"--reward-model {path}: num_labels is {model.config.num_labels}; a reward model has 1")
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Linear):
        raise SystemExit(f"--reward-model {path}: no linear `score` head; use a causal-LM reward model "
                         "(LlamaForSequenceClassification, Qwen2ForSequenceClassification, ...)")
    rm = ScalarHeadModel(backbone_of(model), head)
    disable_dropout(rm)
    return rm.to(device).eval().requires_grad_(False), AutoTokenizer.from_pretrained(path)


def build_critic(policy, reward_model=None, same_tokenizer=False):
    """Critic = a copy of the reward model when its tokenizer is the policy's (N+ detail: the value head starts from
    the reward head, which already predicts the final score), else a copy of the policy's backbone with a
    zero-initialised head, so the first advantages are just the rewards instead of noise from a random head (a random
    head made the demo's accuracy collapse in calibration)."""
    if reward_model is not None and same_tokenizer:
        return copy.deepcopy(reward_model).requires_grad_(True).train()
    backbone = copy.deepcopy(backbone_of(policy))
    head = nn.Linear(policy.config.hidden_size, 1, bias=False).to(policy.device, policy.dtype)
    nn.init.zeros_(head.weight)
    return ScalarHeadModel(backbone, head).requires_grad_(True).train()


CACHE_KWARG = None  # transformers >= 5.2x calls the KV cache `cache`, older versions `past_key_values`


def cache_kwargs(model, cache):
    global CACHE_KWARG
    if CACHE_KWARG is None:
        CACHE_KWARG = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {CACHE_KWARG: cache, "use_cache": True}


def fused_head(model):
    """(backbone, lm_head weight) when logits are exactly hidden @ W.T, so kernels.linear_token_logprobs can compute
    token log-probs without holding the [tokens, vocab] logits; None for models that post-process their logits."""
    head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    if not isinstance(head, nn.Linear) or head.bias is not None or config is None:
        return None
    if any(getattr(config, k, None) not in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
        return None
    return backbone_of(model), head.weight


def sequence_logprobs(model, input_ids, attention_mask, position_ids, response, response_mask, temperature,
                      kept_ids=None, full_logits=False):
    """THE token log-prob function: log pi(response_t | context) under temperature, and the entropy, for the response
    that starts at column P = input_ids.shape[1] - response.shape[1]. The hidden state at column P-1+t predicts
    response token t. Returns (logprobs, entropy), each (B, T) float32 and exactly 0 on masked (pad) tokens."""
    P = input_ids.shape[1] - response.shape[1]
    mask = response_mask.bool()
    fused = None if full_logits else fused_head(model)
    if fused is not None:
        backbone, weight = fused
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids).last_hidden_state[:, P - 1:-1]  # (B, T, H)
        return linear_token_logprobs(hidden, weight, response, temperature, mask=mask, kept_ids=kept_ids)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return token_logprobs(logits[:, P - 1:-1], response, temperature, mask=mask, kept_ids=kept_ids)  # (B, T) x2


# ----------------------------------------------------------------------------------------------------------------
# prompts and rewards


def demo_pairs(eval_size: int):
    """All (a, b) with a, b in 0..99, split once into a fixed held-out set (same for every --seed, so evaluations
    compare across runs) and the training set, never overlapping."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(1234)).tolist()
    return [pairs[i] for i in order[eval_size:]], [pairs[i] for i in order[:eval_size]]  # train, held-out


def addition_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def addition_reward(prompts, completions):
    """The demo's verifiable reward: 1 for the exact sum, else 0. Completions arrive decoded up to (not including)
    EOS; one that never emitted EOS is marked by the caller (see --missing-eos-penalty)."""
    out = []
    for prompt, completion in zip(prompts, completions):
        a, b = prompt.rstrip("=").split("+")
        out.append(1.0 if completion.strip() == str(int(a) + int(b)) else 0.0)
    return out


def load_prompts(path: str):
    if not os.path.isfile(path):
        raise SystemExit(f"--prompts {path}: no such file")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SystemExit(f"--prompts {path}: line {n} is not a JSON object with a 'prompt' field ({e})")
    if not prompts:
        raise SystemExit(f"--prompts {path}: the file holds no prompts")
    return prompts


def load_reward_function(spec: str):
    """'module:function' -> the function; the module is imported from the current directory or sys.path."""
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise SystemExit(f"--reward {spec!r}: expected 'module:function', e.g. my_rewards:score")
    sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"--reward {spec!r}: cannot load it ({e})")


def format_prompts(tokenizer, texts, use_chat_template: bool, max_prompt_length: int):
    """Token ids per prompt: in the tokenizer's chat template (with the generation prompt) when it has one and
    --chat-template is on, else the plain text with the tokenizer's own special tokens. Long prompts keep their
    last tokens (the question is usually at the end); the number cut is printed."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(texts)["input_ids"]
    cut = sum(len(x) > max_prompt_length for x in ids)
    if cut:
        print(f"warning: {cut} of {len(ids)} prompts are longer than --max-prompt-length {max_prompt_length} "
              "tokens and keep only their last tokens")
    return [x[-max_prompt_length:] for x in ids]


def left_pad(seqs, pad_id: int, device):
    """Lists of ids -> (ids, mask), each (B, P), padded on the left so every prompt ends at the same column and the
    first sampled token of every row goes to column P."""
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, P - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, P - len(s):] = 1
    return ids.to(device), mask.to(device)


class PromptStream:
    """Endless epochs over the prompt set, each in a fresh random order from its own generator."""

    def __init__(self, n: int, seed: int):
        self.n, self.generator, self.order = n, torch.Generator().manual_seed(seed), []

    def next_indices(self, batch_size: int):
        out = []
        while len(out) < batch_size:
            if not self.order:
                self.order = torch.randperm(self.n, generator=self.generator).tolist()
            out.append(self.order.pop())
        return out


def positions(mask):  # (B, L) -> (B, L): position ids that count real tokens only, right under left padding
    return (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def reward_model_scores(reward_model, rm_tokenizer, policy_tokenizer, batch, use_chat_template, micro_batch_size):
    """Score each (prompt, completion) with the reward model at its last real token. Same tokenizer: feed the rollout's
    own tokens. Different tokenizer: decode, re-template and re-tokenize for the reward model."""
    if rm_tokenizer.get_vocab() == policy_tokenizer.get_vocab():
        ids = torch.cat([batch.prompt_ids, batch.response], 1)
        mask = torch.cat([batch.prompt_mask, batch.response_mask], 1)
    else:
        if use_chat_template and getattr(rm_tokenizer, "chat_template", None):
            texts = [rm_tokenizer.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant",
                     "content": c}], tokenize=False) for p, c in zip(batch.prompts, batch.completions)]
            seqs = rm_tokenizer(texts, add_special_tokens=False)["input_ids"]
        else:
            seqs = rm_tokenizer([p + c for p, c in zip(batch.prompts, batch.completions)])["input_ids"]
        ids, mask = left_pad(seqs, rm_tokenizer.pad_token_id or 0, batch.response.device)
    last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(-1)  # (B,) last real column
    scores = []
    for rows in torch.arange(ids.shape[0], device=ids.device).split(micro_batch_size):
        out = reward_model(ids[rows], mask[rows], positions(mask[rows]))  # (b, L)
        scores.append(out.gather(1, last[rows, None]).squeeze(1))
    return torch.cat(scores)


def call_reward_function(fn, prompts, completions, device):
    """A user's reward function, checked: one finite number per completion, or a clear error."""
    try:
        scores = fn(prompts, completions)
    except Exception as e:
        raise SystemExit(f"the reward function raised {type(e).__name__}: {e}")
    try:
        scores = [float(s) for s in scores]
    except (TypeError, ValueError) as e:
        raise SystemExit(f"the reward function must return a list of numbers ({e})")
    if len(scores) != len(completions):
        raise SystemExit(f"the reward function returned {len(scores)} scores for {len(completions)} completions")
    return torch.tensor(scores, dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------------------------------------------
# rollout


@dataclass
class Rollout:
    """One batch of B prompts with one completion each. Sampling fills the first block; scoring fills the rest."""
    prompt_ids: torch.Tensor  # (B, P) left-padded prompt tokens
    prompt_mask: torch.Tensor  # (B, P) 1 on real prompt tokens
    response: torch.Tensor  # (B, T) sampled tokens; pad after EOS
    response_mask: torch.Tensor  # (B, T) 1 on real response tokens, the EOS included
    behav_logprobs: torch.Tensor  # (B, T) log-prob of each token under the sampler, recorded at sampling time
    policy_version: torch.Tensor  # (B, T) int64: the policy version (optimizer steps taken) that sampled each token
    ended: torch.Tensor  # (B,) bool: the completion emitted EOS within --response-length
    kept_ids: torch.Tensor = None  # (B, T, K) ids top-k/top-p kept at each step, -1 padded; None without truncation
    prompts: list = None  # B prompt strings as the reward sees them
    completions: list = None  # B completion strings, decoded up to (not including) EOS
    old_logprobs: torch.Tensor = None  # (B, T) recomputed by the trainer's policy before the update
    ref_logprobs: torch.Tensor = None  # (B, T) under the frozen reference
    values: torch.Tensor = None  # (B, T) critic's value of the state before each token
    scores: torch.Tensor = None  # (B,) sequence score (reward model / function), after penalty and whitening
    rewards: torch.Tensor = None  # (B, T) per-token reward: -kl_coef * kl_t, plus the score on the last real token
    advantages: torch.Tensor = None  # (B, T) GAE advantages, whitened over real tokens
    returns: torch.Tensor = None  # (B, T) advantages + values (before whitening): the critic's targets

    def rows(self, index):  # the sub-batch of rows `index` (a LongTensor), tensors only
        return Rollout(**{f.name: (v[index] if isinstance(v, torch.Tensor) else None)
                          for f in dataclasses.fields(self) for v in [getattr(self, f.name)]})


def truncate_logits(scaled_logits, top_k: int, top_p: float):
    """Top-k / top-p filtering of temperature-scaled logits (B, V). Returns (filtered logits, kept ids (B, K) with -1
    on dropped slots). The kept set is recorded so the trainer can renormalise its log-probs over the same set; top-p
    looks at the top --top-k ids only (64 when --top-k is 0) so that the set has a fixed width."""
    V = scaled_logits.shape[-1]
    values, ids = scaled_logits.topk(min(top_k or 64, V), dim=-1)  # (B, K) sorted, largest first
    if top_p < 1.0:
        probs = torch.softmax(scaled_logits, -1).gather(-1, ids)  # (B, K) full-distribution probabilities
        drop = probs.cumsum(-1) - probs >= top_p  # keep the smallest prefix whose mass reaches top_p
        ids = ids.masked_fill(drop, -1)
    keep = ids >= 0  # dropped slots re-write the top token (always kept) with its own value
    filtered = torch.full_like(scaled_logits, float("-inf"))
    filtered.scatter_(-1, torch.where(keep, ids, ids[:, :1]), torch.where(keep, values, values[:, :1]))
    return filtered, ids


@torch.no_grad()
def generate(sampler, prompt_ids, prompt_mask, *, max_new_tokens, temperature, eos_id, pad_id, generator,
             top_k=0, top_p=1.0, policy_version=0):
    """Batched sampling with a KV cache (our own loop, not model.generate, so every detail is visible): left-padded
    prompts with position ids cumsum(mask) - 1, logits / temperature, optional top-k/top-p, per-row stop at EOS with
    pad after it, and each token's log-prob recorded at sampling time by the same function the trainer scores with."""
    from transformers import DynamicCache
    B = prompt_ids.shape[0]
    cache = DynamicCache()
    attention_mask = prompt_mask
    position_ids = positions(prompt_mask)  # (B, P)
    logits = sampler(input_ids=prompt_ids, attention_mask=attention_mask, position_ids=position_ids,
                     **cache_kwargs(sampler, cache)).logits[:, -1]  # (B, V)
    next_position = position_ids[:, -1:] + 1  # (B, 1)
    done = torch.zeros(B, dtype=torch.bool, device=prompt_ids.device)
    tokens, masks, logprobs, kept = [], [], [], []
    for t in range(max_new_tokens):
        scaled = logits.float() / temperature  # (B, V)
        kept_ids = None
        if top_k > 0 or top_p < 1.0:
            scaled, kept_ids = truncate_logits(scaled, top_k, top_p)
            kept.append(kept_ids)
        token = torch.multinomial(torch.softmax(scaled, -1), 1, generator=generator).squeeze(1)  # (B,)
        logprob = token_logprobs(logits, token, temperature, kept_ids=kept_ids)[0]  # (B,)
        alive = ~done
        tokens.append(torch.where(alive, token, pad_id))
        masks.append(alive)
        logprobs.append(torch.where(alive, logprob, 0.0))
        done = done | (alive & (token == eos_id))
        if t == max_new_tokens - 1 or (t % 4 == 3 and bool(done.all())):  # one host sync every 4 steps, not every step
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], 1)
        logits = sampler(input_ids=tokens[-1][:, None], attention_mask=attention_mask, position_ids=next_position,
                         **cache_kwargs(sampler, cache)).logits[:, -1]
        next_position = next_position + 1
    response = torch.stack(tokens, 1)  # (B, T)
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response=response,
                   response_mask=torch.stack(masks, 1).long(), behav_logprobs=torch.stack(logprobs, 1),
                   policy_version=torch.full_like(response, policy_version), ended=done,
                   kept_ids=torch.stack(kept, 1) if kept else None)


def decode_completions(tokenizer, batch: Rollout):
    """Completion text up to (not including) EOS, special tokens dropped: what a reward function reads."""
    lengths = (batch.response_mask.sum(-1) - batch.ended.long()).tolist()  # real tokens minus the EOS
    return tokenizer.batch_decode([r[:n] for r, n in zip(batch.response.tolist(), lengths)], skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------------------------
# scoring and advantages


def masked_mean(x, mask, denom=None):  # mean of x over mask == 1 (or sum / denom); NaN-safe outside the mask
    return torch.where(mask.bool(), x, 0.0).sum() / (mask.sum() if denom is None else denom).clamp(min=1)


def masked_whiten(x, mask, shift_mean=True):
    """(x - mean) / std over the real tokens only: pads neither shift the statistics nor get a value (they stay 0).
    Unbiased variance, as TRL. The hook for cross-rank statistics is the two sums below."""
    mask = mask.bool()
    n = mask.sum()
    mean = torch.where(mask, x, 0.0).sum() / n
    var = torch.where(mask, (x - mean) ** 2, 0.0).sum() / (n - 1).clamp(min=1)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0.0)


def kl_estimate(logprobs, ref_logprobs, estimator: str):
    """Per-token estimators of KL(pi || ref) from samples of pi (Schulman, "Approximating KL Divergence", 2020), with
    log r = ref_logprob - logprob:  k1 = -log r (unbiased, can be negative),  k3 = (r - 1) - log r (unbiased, >= 0)."""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}")


def per_token_rewards(scores, kl, response_mask, kl_coef):
    """r_t = -kl_coef * kl_t on every real token, plus the sequence score on the last real token (never on a pad:
    the index is mask.sum() - 1, and the mask covers exactly the sampled tokens up to and including EOS)."""
    mask = response_mask.bool()
    rewards = torch.where(mask, -kl_coef * kl, 0.0)  # (B, T)
    last = response_mask.sum(-1, keepdim=True) - 1  # (B, 1); every response has >= 1 real token
    return rewards.scatter_add(1, last, scores[:, None].to(rewards.dtype))


def gae(rewards, values, response_mask, gamma: float, lam: float):
    """Generalised advantage estimation (Schulman et al., 2016) over the real tokens of each response:
        delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},   returns_t = A_t + V_t,
    with V and A zero after the last real token (the episode ends there). Returns (advantages, returns), (B, T)."""
    mask = response_mask.bool()
    values = torch.where(mask, values, 0.0)
    rewards = torch.where(mask, rewards, 0.0)
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    last_gae = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(values[:, t])
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = torch.where(mask[:, t], delta + gamma * lam * last_gae, 0.0)
        advantages[:, t] = last_gae
    return advantages, torch.where(mask, advantages + values, 0.0)


def full_sequence(batch: Rollout):  # prompt + response as one left-padded sequence, its mask and position ids
    input_ids = torch.cat([batch.prompt_ids, batch.response], 1)  # (B, P+T)
    attention_mask = torch.cat([batch.prompt_mask, batch.response_mask], 1)  # (B, P+T)
    return input_ids, attention_mask, positions(attention_mask)


def critic_values(critic, batch: Rollout):  # (B, T): V(state before response token t), from column P-1+t
    input_ids, attention_mask, position_ids = full_sequence(batch)
    P = batch.prompt_ids.shape[1]
    values = critic(input_ids, attention_mask, position_ids)[:, P - 1:-1]
    return torch.where(batch.response_mask.bool(), values, 0.0)


@torch.no_grad()
def score_rollouts(batch: Rollout, policy, reference, critic, reward_fn, cfg: Config, row_order=None):
    """Fill in old/ref log-probs, values, scores, rewards, advantages and returns. Forwards run in the same micro-batch
    rows (row_order) as the first training epoch, so the first epoch's ratio is bit-exactly 1 (see ppo_update)."""
    B = batch.response.shape[0]
    micro = cfg.micro_batch_size or B // cfg.minibatches
    row_order = torch.arange(B) if row_order is None else row_order
    old, ref, values = (torch.zeros_like(batch.behav_logprobs) for _ in range(3))
    for rows in row_order.to(batch.response.device).split(micro):
        mb = batch.rows(rows)
        seq = full_sequence(mb)
        old[rows] = sequence_logprobs(policy, *seq, mb.response, mb.response_mask, cfg.temperature, mb.kept_ids,
                                      cfg.full_logits)[0]
        ref[rows] = sequence_logprobs(reference, *seq, mb.response, mb.response_mask, cfg.temperature, mb.kept_ids,
                                      cfg.full_logits)[0]
        values[rows] = critic_values(critic, mb)
    batch.old_logprobs, batch.ref_logprobs, batch.values = old, ref, values
    scores = reward_fn(batch)  # (B,)
    scores = scores - cfg.missing_eos_penalty * (~batch.ended).float()  # N+ detail: penalise runs cut off without EOS
    if cfg.whiten_scores:
        scores = masked_whiten(scores, torch.ones_like(scores))
    batch.scores = scores
    kl = torch.where(batch.response_mask.bool(), kl_estimate(old, ref, cfg.kl_estimator), 0.0)  # (B, T)
    batch.rewards = per_token_rewards(scores, kl, batch.response_mask, cfg.kl_coef)
    advantages, batch.returns = gae(batch.rewards, values, batch.response_mask, cfg.gamma, cfg.lam)
    batch.advantages = masked_whiten(advantages, batch.response_mask)
    return kl


# ----------------------------------------------------------------------------------------------------------------
# PPO loss


def policy_loss(logprobs, old_logprobs, advantages, mask, clip_range, n_tokens=None):
    """Clipped surrogate (Schulman et al., 2017), averaged over real tokens (token-level mean: every token of the
    minibatch weighs the same, however long its sequence):
        ratio_t = exp(logp_t - old_logp_t),
        L = mean_t max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps, 1 + eps)).
    n_tokens: the denominator, the real tokens of the whole minibatch when this is one micro-batch of it.
    Returns (loss, stats) with clip fraction and approx KL(old || new) = mean (ratio - 1) - log ratio (k3)."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask, n_tokens)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), mask, n_tokens),
                 "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask, n_tokens),
                 "ratio_max_dev": torch.where(mask.bool(), (ratio - 1).abs(), 0.0).max()}
    return loss, stats


def value_loss(values, old_values, returns, mask, clip_range, n_tokens=None):
    """Clipped value loss (as in OpenAI's baselines / the N+ details): the prediction may move at most clip_range
    from the rollout's value, and the worse of the clipped and unclipped squared errors is taken:
        L = 0.5 * mean_t max((V_t - R_t)^2, (old_V_t + clip(V_t - old_V_t, -c, c) - R_t)^2)."""
    clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    loss = 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask, n_tokens)
    with torch.no_grad():
        stats = {"vf_clipfrac": masked_mean(((values - returns) ** 2 < (clipped - returns) ** 2).to(values.dtype), mask, n_tokens)}
    return loss, stats


def explained_variance(values, returns, mask):
    """1 - Var[R - V] / Var[R] over real tokens: 1 = the critic predicts the returns, 0 = no better than their mean."""
    mask = mask.bool()
    r, v = returns[mask], values[mask]
    return 1.0 - (r - v).var() / r.var().clamp(min=1e-8)


# ----------------------------------------------------------------------------------------------------------------
# update


def ppo_update(policy, critic, policy_opt, critic_opt, batch: Rollout, cfg: Config, row_orders):
    """ppo_epochs x minibatches optimizer steps on one rollout batch, each minibatch as micro-batches whose gradients
    accumulate (the losses are divided by the minibatch's token count, so accumulation gives the same token mean as
    one big batch). row_orders[e] is epoch e's shuffled row order; epoch 0's is the one scoring used."""
    B = batch.response.shape[0]
    minibatch_size = B // cfg.minibatches
    micro = cfg.micro_batch_size or minibatch_size
    sums, n_total = {}, 0
    for epoch in range(cfg.ppo_epochs):
        for mb_rows in row_orders[epoch].to(batch.response.device).split(minibatch_size):
            mb_tokens = batch.response_mask[mb_rows].sum()
            for rows in mb_rows.split(micro):
                mb = batch.rows(rows)
                seq = full_sequence(mb)
                logprobs, entropy = sequence_logprobs(policy, *seq, mb.response, mb.response_mask, cfg.temperature,
                                                      mb.kept_ids, cfg.full_logits)
                pg_loss, pg_stats = policy_loss(logprobs, mb.old_logprobs, mb.advantages, mb.response_mask,
                                                cfg.clip_range, mb_tokens)
                entropy_mean = masked_mean(entropy, mb.response_mask, mb_tokens)
                (pg_loss - cfg.entropy_coef * entropy_mean).backward()
                values = critic_values(critic, mb)
                vf_loss, vf_stats = value_loss(values, mb.values, mb.returns, mb.response_mask, cfg.value_clip_range,
                                               mb_tokens)
                vf_loss.backward()
                step_stats = {"pg_loss": pg_loss.detach(), "vf_loss": vf_loss.detach(), "entropy": entropy_mean.detach(),
                              **pg_stats, **vf_stats}
                for k, v in step_stats.items():  # token-weighted sums of the micro-batch means; .item() only at the end
                    if k == "ratio_max_dev":
                        if epoch == 0 and n_total == 0:  # the first minibatch: must be exactly 0 (same weights)
                            sums["first_ratio_max_dev"] = torch.maximum(sums.get("first_ratio_max_dev", v), v)
                        continue
                    sums[k] = sums.get(k, 0.0) + v
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            critic_grad_norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), cfg.max_grad_norm)
            policy_opt.step(), critic_opt.step()
            policy_opt.zero_grad(set_to_none=True), critic_opt.zero_grad(set_to_none=True)
            sums["grad_norm"] = sums.get("grad_norm", 0.0) + grad_norm
            sums["critic_grad_norm"] = sums.get("critic_grad_norm", 0.0) + critic_grad_norm
            n_total += 1
    stats = {k: float(v) / (1 if k == "first_ratio_max_dev" else n_total) for k, v in sums.items()}
    return stats


# ----------------------------------------------------------------------------------------------------------------
# the built-in demo: supervised warm-up and held-out evaluation


def answer_batch(tokenizer, prompt_ids, answers, device):
    """A Rollout holding prompts and given answers (+ EOS), the layout sampling produces; for supervised steps."""
    ids, mask = left_pad(prompt_ids, tokenizer.pad_token_id, device)
    targets = [tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for a in answers]
    T = max(len(t) for t in targets)
    response = torch.tensor([t + [tokenizer.pad_token_id] * (T - len(t)) for t in targets], device=device)
    response_mask = torch.tensor([[1] * len(t) + [0] * (T - len(t)) for t in targets], device=device)
    return Rollout(ids, mask, response, response_mask, None, None, None)


@torch.no_grad()
def evaluate(policy, tokenizer, prompt_ids, prompt_texts, cfg: Config, seed: int, chunk=500):
    """Sampled accuracy (temperature --temperature, the same sampling as training) on the given prompts; the
    generator is re-seeded each time, so successive evaluations differ only by the weights. Returns (acc, samples)."""
    device = policy.device
    generator = torch.Generator(device).manual_seed(seed)
    correct, samples = 0.0, []
    for start in range(0, len(prompt_ids), chunk):
        ids, mask = left_pad(prompt_ids[start:start + chunk], tokenizer.pad_token_id, device)
        batch = generate(policy, ids, mask, max_new_tokens=cfg.response_length, temperature=cfg.temperature,
                         eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, generator=generator,
                         top_k=cfg.top_k, top_p=cfg.top_p)
        texts, completions = prompt_texts[start:start + chunk], decode_completions(tokenizer, batch)
        scores = [s * bool(e) for s, e in zip(addition_reward(texts, completions), batch.ended.tolist())]
        correct += sum(scores)
        samples += list(zip(texts, completions, scores))[:3 - len(samples)]
    return correct / len(prompt_ids), samples


def demo_warmup(policy, tokenizer, train_pairs, cfg: Config):
    """Supervised warm-up on the addition task until sampled accuracy on 256 fresh training prompts reaches
    --demo-warmup-target (checked every 10 steps), so PPO starts from a policy that is sometimes right. The jump in
    accuracy comes anywhere between ~250 and 600+ steps depending on the seed, hence adaptive, not a fixed count.
    Cached on disk by (model config, vocabulary, seed, warm-up settings): a second run loads it."""
    key = json.dumps([policy.config.to_json_string(), sorted(tokenizer.get_vocab().items()), cfg.seed,
                      cfg.demo_warmup_lr, cfg.demo_warmup_target, cfg.demo_warmup_max_steps, "v1"])
    path = os.path.join(os.path.expanduser(cfg.demo_cache), f"demo-warmup-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt")
    if os.path.exists(path):
        saved = torch.load(path, map_location=policy.device)
        policy.load_state_dict(saved["state_dict"])
        print(f"warm-up: loaded {path} ({saved['steps']} steps, sampled train accuracy {saved['accuracy']:.2f})")
        return
    if cfg.demo_warmup_max_steps == 0:
        return
    device, t0 = policy.device, time.time()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.demo_warmup_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50))  # 50-step LR warm-up
    rng = random.Random(cfg.seed)
    all_ids = format_prompts(tokenizer, [addition_prompt(a, b) for a, b in train_pairs], False, 64)
    accuracy, step = 0.0, 0
    for step in range(1, cfg.demo_warmup_max_steps + 1):
        rows = rng.sample(range(len(train_pairs)), 128)
        batch = answer_batch(tokenizer, [all_ids[i] for i in rows], [str(sum(train_pairs[i])) for i in rows], device)
        logprobs, _ = sequence_logprobs(policy, *full_sequence(batch), batch.response, batch.response_mask, 1.0,
                                        full_logits=cfg.full_logits)
        loss = -masked_mean(logprobs, batch.response_mask)  # cross-entropy on the answer and its EOS only
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step(), schedule.step(), optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0:
            rows = rng.sample(range(len(train_pairs)), 256)
            accuracy, _ = evaluate(policy, tokenizer, [all_ids[i] for i in rows],
                                   [addition_prompt(*train_pairs[i]) for i in rows], cfg, seed=step)
            print(f"\rwarm-up step {step}: loss {loss.item():.3f}, sampled train accuracy {accuracy:.2f}", end="", flush=True)
            if accuracy >= cfg.demo_warmup_target:
                break
    print(f"\nwarm-up: {step} steps in {time.time() - t0:.1f} s, sampled train accuracy {accuracy:.2f}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"state_dict": policy.state_dict(), "steps": step, "accuracy": accuracy}, path + ".tmp")
    os.replace(path + ".tmp", path)  # atomic: a killed run never leaves a half-written cache entry


# ----------------------------------------------------------------------------------------------------------------
# logging and checkpoints


class Logger:
    """metrics.jsonl (one JSON object per line, flushed each time) and, only with --wandb-project, wandb."""

    def __init__(self, cfg: Config, output_dir: str):
        self.file = open(os.path.join(output_dir, "metrics.jsonl"), "a", encoding="utf-8")
        self.wandb = None
        if cfg.wandb_project:
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


def prepare_output_dir(cfg: Config) -> str:
    path = cfg.output_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    if os.path.exists(os.path.join(path, "metrics.jsonl")):
        raise SystemExit(f"--output-dir {path} already holds a run (metrics.jsonl); choose another directory")
    os.makedirs(path, exist_ok=True)
    return path


def write_json(obj, path: str):  # via a temporary file and a rename, so a crash never leaves half a file
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


def save_policy(policy, tokenizer, path: str):
    """save_pretrained + tokenizer into path, written beside it first and renamed into place."""
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)


def format_line(r: dict, steps: int) -> str:
    acc = f" | acc {r['eval_accuracy']:.3f}" if "eval_accuracy" in r else ""
    return (f"it {r['step']:>4}/{steps} | reward {r['reward_mean']:.3f}{acc} | kl {r['kl']:.4f} | ent {r['entropy']:.3f}"
            f" | clip {r['clipfrac']:.3f} | vloss {r['vf_loss']:.4f} | ev {r['explained_variance']:.2f}"
            f" | len {r['response_length']:.1f} | gen {r['gen_tokens_per_s']:.0f} tok/s"
            f" | train {r['train_tokens_per_s']:.0f} tok/s | {r['iter_s']:.2f}s")


# ----------------------------------------------------------------------------------------------------------------
# main


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: CUDA is not available here; use --device cpu")
    return torch.device(name)


def linear_decay(cfg: Config):  # LR multiplier after `s` scheduler steps (one per iteration)
    return (lambda s: max(0.0, 1.0 - s / cfg.steps)) if cfg.lr_decay else (lambda s: 1.0)


def main(argv=None):
    cfg = parse_config(argv)
    device, dtype = resolve_device(cfg.device), getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed)
    output_dir = prepare_output_dir(cfg)

    # models: policy (trained, also the sampler in this synchronous loop), reference (frozen), critic, reward
    if cfg.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        policy = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype)
    else:
        tokenizer = build_demo_tokenizer()
        policy = build_demo_policy(tokenizer, cfg.seed)
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"the tokenizer of {cfg.model or 'the demo'} has no EOS token; set eos_token in its config")
    ensure_pad_token(tokenizer, policy)
    disable_dropout(policy)
    policy.to(device, dtype).eval()  # eval mode too: dropout off twice over; gradients still flow

    # prompts
    if cfg.prompts:
        prompt_texts = load_prompts(cfg.prompts)
    else:
        train_pairs, eval_pairs = demo_pairs(cfg.eval_size)
        prompt_texts = [addition_prompt(a, b) for a, b in train_pairs]
        eval_texts = [addition_prompt(a, b) for a, b in eval_pairs]
        eval_ids = format_prompts(tokenizer, eval_texts, cfg.chat_template, cfg.max_prompt_length)
        demo_warmup(policy, tokenizer, train_pairs, cfg)
    prompt_ids = format_prompts(tokenizer, prompt_texts, cfg.chat_template, cfg.max_prompt_length)
    reference = copy.deepcopy(policy).requires_grad_(False)

    reward_model, same_tokenizer = None, False
    if cfg.reward_model:
        if not os.path.isdir(cfg.reward_model):
            raise SystemExit(f"--reward-model {cfg.reward_model}: no such directory")
        reward_model, rm_tokenizer = load_reward_model(cfg.reward_model, device, dtype)
        same_tokenizer = rm_tokenizer.get_vocab() == tokenizer.get_vocab()
        reward_fn = lambda b: reward_model_scores(reward_model, rm_tokenizer, tokenizer, b, cfg.chat_template,
                                                  cfg.micro_batch_size or cfg.batch_size // cfg.minibatches)
    else:
        rule = load_reward_function(cfg.reward) if cfg.reward else addition_reward
        demo_rule = not cfg.reward  # the demo's exact match includes the EOS: digits then stop
        reward_fn = lambda b: call_reward_function(rule, b.prompts, b.completions, device) * (b.ended if demo_rule else 1)
    critic = build_critic(policy, reward_model, same_tokenizer)
    print(f"policy {sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M parameters on {device}; critic from "
          f"{'the reward model' if reward_model is not None and same_tokenizer else 'the policy, zero-initialised head'}")

    policy_opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, linear_decay(cfg)) for o in (policy_opt, critic_opt)]
    write_json(dataclasses.asdict(cfg), os.path.join(output_dir, "config.json"))  # the config actually used
    logger = Logger(cfg, output_dir)

    # the loop: sample -> score -> update, synchronously
    stream = PromptStream(len(prompt_ids), cfg.seed)
    sample_generator = torch.Generator(device).manual_seed(cfg.seed)
    shuffle_generator = torch.Generator().manual_seed(cfg.seed + 1)
    eval_seed = cfg.seed + 2
    start, history = time.time(), []
    if is_demo(cfg):
        first_accuracy, samples = evaluate(policy, tokenizer, eval_ids, eval_texts, cfg, eval_seed)
        logger.log({"step": 0, "eval_accuracy": first_accuracy, "time_s": 0.0})
        print(f"held-out sampled accuracy before PPO: {first_accuracy:.3f}")
    for step in range(1, cfg.steps + 1):
        t0 = time.time()
        rows = stream.next_indices(cfg.batch_size)
        ids, mask = left_pad([prompt_ids[i] for i in rows], tokenizer.pad_token_id, device)
        batch = generate(policy, ids, mask, max_new_tokens=cfg.response_length, temperature=cfg.temperature,
                         eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, generator=sample_generator,
                         top_k=cfg.top_k, top_p=cfg.top_p, policy_version=step - 1)
        batch.prompts, batch.completions = [prompt_texts[i] for i in rows], decode_completions(tokenizer, batch)
        t_gen = time.time()
        row_orders = [torch.randperm(cfg.batch_size, generator=shuffle_generator) for _ in range(cfg.ppo_epochs)]
        kl = score_rollouts(batch, policy, reference, critic, reward_fn, cfg, row_orders[0])
        t_score = time.time()
        stats = ppo_update(policy, critic, policy_opt, critic_opt, batch, cfg, row_orders)
        for schedule in schedules:
            schedule.step()
        t_end = time.time()

        response_tokens = int(batch.response_mask.sum())
        sequence_tokens = response_tokens + int(batch.prompt_mask.sum())
        raw_scores = batch.scores + cfg.missing_eos_penalty * (~batch.ended).float()  # before the penalty
        record = {"step": step, "reward_mean": float(raw_scores.mean()) if not cfg.whiten_scores else None,
                  "score_mean": float(batch.scores.mean()), "kl": float(kl.sum(-1).mean()),
                  "kl_per_token": float(masked_mean(kl, batch.response_mask)), **stats,
                  "explained_variance": float(explained_variance(batch.values, batch.returns, batch.response_mask)),
                  "response_length": response_tokens / cfg.batch_size, "response_tokens": response_tokens,
                  "eos_fraction": float(batch.ended.float().mean()), "lr": schedules[0].get_last_lr()[0],
                  "gen_s": t_gen - t0, "score_s": t_score - t_gen, "update_s": t_end - t_score, "iter_s": t_end - t0,
                  "gen_tokens_per_s": response_tokens / (t_gen - t0),
                  "train_tokens_per_s": cfg.ppo_epochs * sequence_tokens / (t_end - t_score)}
        if record["reward_mean"] is None:
            record["reward_mean"] = record["score_mean"]
        if is_demo(cfg) and (step % cfg.eval_every == 0 or step == cfg.steps):
            record["eval_accuracy"], samples = evaluate(policy, tokenizer, eval_ids, eval_texts, cfg, eval_seed)
        record["time_s"] = time.time() - start
        logger.log(record)
        history.append(record)
        print(format_line(record, cfg.steps), flush=True)
        if cfg.sample_every and (step % cfg.sample_every == 0 or step == 1):
            for p, c, s in zip(batch.prompts[:3], batch.completions[:3], raw_scores[:3].tolist()):
                print(f"    {p!r} -> {c!r}  (score {s:.2f})")

    save_policy(policy, tokenizer, os.path.join(output_dir, "policy"))
    logger.close()
    first, last = history[: max(1, len(history) // 10)], history[-max(1, len(history) // 10):]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
    print(f"\ndone: {cfg.steps} iterations in {time.time() - start:.0f} s; reward mean {mean(first, 'reward_mean'):.3f} "
          f"(first tenth) -> {mean(last, 'reward_mean'):.3f} (last tenth)")
    if is_demo(cfg):
        print(f"held-out sampled accuracy: {first_accuracy:.3f} before PPO -> {history[-1]['eval_accuracy']:.3f} after")
    print(f"policy saved to {os.path.join(output_dir, 'policy')}; metrics in {os.path.join(output_dir, 'metrics.jsonl')}")


if __name__ == "__main__":
    main()
