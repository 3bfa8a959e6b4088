"""The run.toml schema: one frozen dataclass per table, with types, defaults, ranges and help.

Key names follow the public retrograd-rs schema where it has the concept, so its users can bring
their TOML; `help` strings feed `retrograd config-schema` and error messages.
This module only declares; validation lives in `config/load.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

REQUIRED = object()  # sentinel default: the key must be given


def opt(default: Any = None, *, help: str, choices: tuple | None = None, min: float | None = None,
        max: float | None = None, min_exclusive: bool = False, max_exclusive: bool = False,
        path: bool = False, trajectory: bool = True):
    """Declare one key. `trajectory=False` marks keys that never change the trained weights (they
    are left out of the checkpoint fingerprint, so changing them does not block a resume)."""
    meta = dict(help=help, choices=choices, min=min, max=max, min_exclusive=min_exclusive,
                max_exclusive=max_exclusive, path=path, trajectory=trajectory,
                required=default is REQUIRED)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=None if default is REQUIRED else default, metadata=meta)


ALGORITHMS = ("sft", "preference", "ppo", "grpo", "distill", "agent_grpo")
SUPPORTED_ALGORITHMS = ("sft", "preference", "grpo", "ppo", "distill")


@dataclass(frozen=True)
class RunTable:
    algorithm: str = opt(REQUIRED, help="which training algorithm runs", choices=ALGORITHMS)
    name: Optional[str] = opt(None, help="run name (default: the TOML file's name)", trajectory=False)
    directory: Optional[str] = opt(None, path=True, trajectory=False,
                                   help="run folder for metrics.jsonl and the resolved config "
                                        "(default: runs/<name> beside the TOML)")
    verbose: bool = opt(False, help="print every logged metric on the terminal each step", trajectory=False)


@dataclass(frozen=True)
class ModelTable:
    path: str = opt(REQUIRED, help="HF model folder, .gguf file, or built-in alias "
                                   "(smollm2-135m-instruct)", trajectory=False)
    device: str = opt("auto", help="auto|cpu|cuda", choices=("auto", "cpu", "cuda", "gpu"),
                      trajectory=False)
    dtype: str = opt("float32", help="compute dtype of the base weights",
                     choices=("float32", "bfloat16", "float16"))


@dataclass(frozen=True)
class OutputTable:
    path: str = opt(REQUIRED, path=True, trajectory=False,
                    help="where the final result goes: a .gguf LoRA adapter for llama.cpp, a PEFT adapter "
                         "folder (LoRA) or an HF model folder (full)")
    kind: Optional[str] = opt(None, choices=("peft", "model", "adapter"), trajectory=False,
                              help="adapter (llama.cpp GGUF LoRA), peft (adapter folder) or model (HF folder, a LoRA merged in); "
                                   "default follows the path (*.gguf -> adapter) and training.trainable")


@dataclass(frozen=True)
class LoraTable:
    rank: int = opt(8, help="LoRA rank r", min=1, max=4096)
    alpha: float = opt(16.0, help="LoRA alpha; the update is scaled by alpha/rank", min=0, min_exclusive=True)
    targets: list = opt(["auto"], help='modules to adapt: ["auto"] (every linear layer of the blocks), '
                                       'aliases q,k,v,o,ffn_up,ffn_down,ffn_gate, or module names such as q_proj')
    dropout: float = opt(0.0, help="dropout on the LoRA input", min=0, max=1, max_exclusive=True)
    seed: int = opt(42, help="seed of the adapter initialisation")
    dtype: str = opt("f32", choices=("f32", "f16", "bf16"), trajectory=False,
                     help="storage dtype of the written adapter; training always keeps f32 weights")
    init_adapter: Optional[str] = opt(None, path=True, trajectory=False,
                                      help="start from an existing adapter (PEFT folder or llama.cpp .gguf), "
                                           "weights only; rank, alpha and targets are read from it")


@dataclass(frozen=True)
class TrainingTable:
    trainable: str = opt("lora", choices=("lora", "full"), help="train a LoRA adapter or every weight")
    optimizer: str = opt("adamw", choices=("adamw", "sgd"), help="adamw (decoupled weight decay) or sgd")
    lr: float = opt(1e-4, help="peak learning rate", min=0, min_exclusive=True)
    lr_scheduler: str = opt("constant", choices=("constant", "linear", "cosine"),
                            help="constant, or linear/cosine decay to 0 at the last step")
    warmup_steps: int = opt(0, min=0, help="linear warm-up steps from 0 to lr")
    weight_decay: float = opt(0.0, min=0, max=1, help="decoupled weight decay")
    max_grad_norm: float = opt(1.0, min=0, help="global L2 gradient clipping; 0 disables it")
    adam_beta1: float = opt(0.9, min=0, max=1, max_exclusive=True, help="AdamW beta1")
    adam_beta2: float = opt(0.999, min=0, max=1, max_exclusive=True, help="AdamW beta2")
    adam_epsilon: float = opt(1e-8, min=0, min_exclusive=True, help="AdamW epsilon")
    epochs: int = opt(1, min=1, help="passes over the training data")
    max_steps: Optional[int] = opt(None, min=1, help="stop after this many optimizer steps (overrides epochs)")
    batch_size: int = opt(4, min=1, help="sequences per micro-batch")
    gradient_accumulation: int = opt(1, min=1, help="micro-batches per optimizer step")
    micro_batch: Optional[int] = opt(None, min=1,
                                     help="most tokens (rows x padded length) per forward/backward pass; a "
                                          "micro-batch is split into passes of whole rows that fit, with the same "
                                          "update (the main memory knob). CPU default 512 (GRPO, full: 1024); GPU: none")
    ctx: int = opt(512, min=8, help="maximum sequence length in tokens (longer rows are truncated)")
    seed: int = opt(42, help="seed of data order, dropout and everything random in the loop")
    threads: Optional[int] = opt(None, min=1, trajectory=False, help="torch CPU threads (default: all cores)")
    gradient_checkpointing: bool = opt(False, trajectory=False,
                                       help="recompute activations in backward to save memory")
    compile: bool = opt(False, help="run training passes through torch.compile (Llama-family models): faster "
                                    "passes after the first ones compile (minutes); off for short runs")


@dataclass(frozen=True)
class SftTable:
    data: str = opt(REQUIRED, path=True, trajectory=False,
                    help='training data: .jsonl ({"messages": [...]}, prompt/completion or text rows), '
                         'a .txt file, or builtin:NAME')
    data_format: str = opt("auto", choices=("auto", "jsonl", "text"),
                           help="jsonl or text; auto infers it from the extension")
    shuffle: bool = opt(True, help="shuffle rows each epoch (seeded by training.seed)")
    assistant_only_loss: bool = opt(True, help="train only on assistant turns / completions")
    template_variables: dict = opt({}, help="extra variables passed to the chat template")


@dataclass(frozen=True)
class PreferenceTable:
    data: str = opt(REQUIRED, path=True, trajectory=False,
                    help='preference pairs: .jsonl rows {"prompt": [messages] | "text", "chosen": ..., "rejected": ...}, '
                         "or builtin:NAME")
    loss: str = opt("dpo", choices=("dpo", "ipo", "simpo", "orpo"), help="dpo, ipo, simpo or orpo")
    beta: Optional[float] = opt(None, min=0, min_exclusive=True,
                                help="loss temperature (default 0.1; 2.0 for simpo; for orpo the odds-ratio weight lambda)")
    reference: Optional[str] = opt(None, choices=("initial", "base"),
                                   help="dpo/ipo: the policy as training starts (initial, default) or the base model "
                                        "with the adapter disabled (base); [reference] model overrides both")
    label_smoothing: Optional[float] = opt(None, min=0, max=0.5, max_exclusive=True,
                                           help="dpo only: conservative DPO's label noise (default 0)")
    gamma_beta_ratio: Optional[float] = opt(None, min=0, help="simpo only: the target margin gamma / beta (default 0.5)")
    shuffle: bool = opt(True, help="shuffle pairs each epoch (seeded by training.seed)")
    pairs_per_step: Optional[int] = opt(None, min=1,
                                        help="pairs per optimizer step (default training.batch_size x gradient_accumulation)")
    logps_drop_warn: float = opt(2.0, min=0, trajectory=False,
                                 help="dpo/ipo: warn once when the chosen responses' summed log-probability falls this "
                                      "many nats below the reference")
    template_variables: dict = opt({}, help="extra variables passed to the chat template")


@dataclass(frozen=True)
class GrpoSamplingTable:
    max_new_tokens: int = opt(128, min=1, help="most tokens sampled per completion")
    temperature: float = opt(1.0, min=0, min_exclusive=True, help="sampling temperature")
    top_p: float = opt(1.0, min=0, max=1, min_exclusive=True, help="nucleus sampling mass")
    top_k: int = opt(0, min=0, help="sample among the k most likely tokens (0: all)")
    seed: int = opt(42, help="seed of the sampler (each update draws from seed + update)")
    stop: list = opt([], help="strings that end a completion (EOS always does)")
    dtype: str = opt("auto", choices=("auto", "float32", "bfloat16"),
                     help="precision of the sampler's matmuls: auto follows model.dtype (bfloat16 for a "
                          "bfloat16 model, else float32), except on a CPU without native bf16, where it picks "
                          "float32; bfloat16 is ~1.5x faster on CPUs with AVX512-BF16 and several times slower on "
                          "CPUs without. Training log-probs are computed at model.dtype either way")


@dataclass(frozen=True)
class GrpoOverlongTable:
    buffer_tokens: int = opt(REQUIRED, min=1, help="the last N tokens before max_new_tokens where the penalty ramps")
    max_penalty: float = opt(1.0, min=0, help="penalty at max_new_tokens")


@dataclass(frozen=True)
class GrpoKlScheduleTable:
    warmup_updates: int = opt(0, min=0, help="ramp the KL coefficient linearly from 0 over N updates")
    target: Optional[float] = opt(None, min=0, min_exclusive=True,
                                  help="adapt the KL coefficient (x1.5 / /1.5) to keep the measured KL near this")


@dataclass(frozen=True)
class GrpoDynamicSamplingTable:
    max_resample_factor: int = opt(2, min=2, help="sample up to prompts_per_update x N groups to find groups with signal")


@dataclass(frozen=True)
class GrpoTable:
    prompts: str = opt(REQUIRED, path=True, trajectory=False,
                       help='prompt rows: .jsonl {"messages": [...]} or {"prompt": ...} plus reward columns '
                            '(e.g. "answer"), or builtin:NAME')
    updates: Optional[int] = opt(None, min=1, help="policy updates (default: training.max_steps, else one pass "
                                                   "over the prompts x training.epochs)")
    prompts_per_update: int = opt(4, min=1, help="prompts sampled per update")
    group_size: int = opt(8, min=2, max=256, help="completions per prompt")
    grpo_epochs: int = opt(1, min=1, help="optimizer steps per update on the same completions")
    clip_range_low: float = opt(0.2, min=0, max=1, help="ratio clip below 1")
    clip_range_high: float = opt(0.28, min=0, help="ratio clip above 1 (clip-higher)")
    kl_coefficient: float = opt(0.0, min=0, help="weight of the k3 KL to the reference (0 skips the reference pass)")
    importance_sampling_level: str = opt("token", choices=("token", "sequence"),
                                         help="token, or sequence (GSPO: the same as policy_loss = \"gspo\")")
    baseline: str = opt("mean", choices=("mean", "leave_one_out", "rloo"),
                        help="group baseline: mean, or leave-one-out (the same as advantage_mode = \"rloo\")")
    scale_rewards: str = opt("none", choices=("none", "std"),
                             help="none (Dr. GRPO) or divide advantages by the group std (original GRPO; the same "
                                  "as advantage_mode = \"grpo_std\")")
    # ---- credit assignment: episode advantages x token transforms (retrain's names and maths) ----
    algorithm_mode: Optional[str] = opt(None, help="a named recipe setting advantage_mode and transform_mode: "
                                                   "grpo_none, maxrl_none, maxrl_gtpo, maxrl_gtpo_hicra, maxrl_gtpo_sepa, "
                                                   "reinforce_pp_{none,gtpo,gtpo_sepa,delight,delight_sepa}, "
                                                   "discover_entropic (`retrograd plugins` lists them)")
    advantage_mode: Optional[str] = opt(None, help="episode advantage of each completion: grpo (r - group mean; "
                                                   "default), rloo, grpo_std, maxrl, reinforce_pp, discover_entropic, "
                                                   "or your own 'module:function'")
    transform_mode: Optional[str] = opt(None, help="token-level credit: none (default), gtpo, gtpo_hicra, gtpo_sepa, "
                                                   "gtpo_sepa_amp, gtpo_sepa_amp_c, entropy_mask, delight, delight_sepa, "
                                                   "hard_delight, or your own 'module:function'")
    uncertainty_kind: Optional[str] = opt(None, help="the token uncertainty GTPO-family transforms weigh by: "
                                                     "surprisal (default), predictive_variance, shannon_entropy")
    batch_advantage_norm: bool = opt(False, help="REINFORCE++: normalise the non-zero token advantages over the "
                                                 "whole update (mean 0, std 1)")
    adv_clip_max: float = opt(0.0, min=0, help="clamp token advantages to [-C, C] (0: off)")
    advantage_params: dict = opt({}, help="[grpo.advantage_params]: parameters of the advantage mode "
                                          "(discover_entropic: beta, target_kl, beta_max; a plugin's own)")
    transform_params: dict = opt({}, help="[grpo.transform_params]: parameters of a plugin transform")
    # ---- the policy loss ----
    policy_loss: str = opt("clip", help="clip (PPO clip with Clip-Higher and dual-clip), gspo, cispo, sapo, gmpo, "
                                        "kl_cov, clip_cov, importance_sampling, dro, or your own 'module:function'")
    clip_ratio_c: float = opt(3.0, min=0, help="dual-clip: for A < 0 the objective is at most c * |A| "
                                               "(0 turns it off; else > 1)")
    policy_loss_params: dict = opt({}, help="[grpo.policy_loss_params]: the loss's own parameters (sapo: tau_pos, "
                                            "tau_neg; kl_cov: kl_cov_ratio, kl_cov_coef; ...)")
    importance_correction: str = opt("none", choices=("none", "token_truncate", "token_mask", "sequence_truncate",
                                                      "sequence_mask"),
                                     help="off-policy correction of the sampler's distribution (TIS / MIS, as TRL's "
                                          "vllm_importance_sampling_mode): ratio of the training policy to the sampler")
    importance_correction_max: float = opt(3.0, min=0, min_exclusive=True, help="upper bound of the correction ratio")
    importance_correction_min: Optional[float] = opt(None, min=0, help="lower bound (mask modes; default none)")
    loss_normalisation: str = opt("constant", choices=("token", "constant", "sequence"),
                                  help="constant: / (completions x max_new_tokens) (Dr. GRPO); token: / tokens "
                                       "(DAPO); sequence: per-completion mean (GRPO)")
    mask_truncated: bool = opt(False, help="leave out of the loss completions that hit max_new_tokens")
    prompt_order: str = opt("shuffled", choices=("sequential", "shuffled"), help="order prompts are taken in")
    max_stalled_updates: int = opt(25, min=0, help="stop after N updates in a row without learning signal (0: never)")
    rewards: list = opt([], help='reward functions: [[grpo.rewards]] tables with type = "match" | "math" | "format" '
                                 '| "length" | "python" | "command", weight and their options')
    reward_command: Optional[list] = opt(None, trajectory=False,
                                         help="argv of a retrograd-reward/1 program (added to the rewards, weight 1)")
    reward_mode: str = opt("persistent", choices=("persistent", "oneshot"), help="reward_command mode")
    reward_timeout_seconds: float = opt(300.0, min=0, min_exclusive=True, trajectory=False,
                                        help="most seconds a reward batch may take")
    log_completions_every: int = opt(1, min=0, trajectory=False,
                                     help="write sampled completions to completions.jsonl every N updates (0: never)")
    template_variables: dict = opt({}, help="extra variables passed to the chat template")
    sampling: dict = opt({}, help="[grpo.sampling]: max_new_tokens, temperature, top_p, top_k, seed, stop")
    overlong_penalty: Optional[dict] = opt(None, help="[grpo.overlong_penalty]: buffer_tokens, max_penalty")
    kl_schedule: Optional[dict] = opt(None, help="[grpo.kl_schedule]: warmup_updates, target")
    dynamic_sampling: Optional[dict] = opt(None, help="[grpo.dynamic_sampling]: max_resample_factor")
    gtpo: Optional[dict] = opt(None, help="[grpo.gtpo]: beta (GTPO's uncertainty weighting)")
    hicra: Optional[dict] = opt(None, help="[grpo.hicra]: alpha (planning-token amplification)")
    planning: Optional[dict] = opt(None, help="[grpo.planning]: detector, strategic_grams, model, threshold")
    sepa: Optional[dict] = opt(None, help="[grpo.sepa]: steps, schedule, delay_steps, correct_rate_gate")
    delight: Optional[dict] = opt(None, help="[grpo.delight]: eta, eta_mode, norm_mode, lambda, k_frac, ...")
    entropy_mask: Optional[dict] = opt(None, help="[grpo.entropy_mask]: rho")
    judge: Optional[dict] = opt(None, help="[grpo.judge]: an OpenAI-compatible LLM judge as one more reward")
    judge_weight: Optional[float] = opt(None, help="with a judge (required): reward + judge_weight x verdict in [0, 1]")
    judge_failure: str = opt("drop_group", choices=("drop_group", "fail"),
                             help="a group the judge fails on: left out of the update, or the run stops")
    max_judge_dropped_fraction: float = opt(0.5, min=0, max=1,
                                            help="stop when the judge fails on more of an update's groups than this")


@dataclass(frozen=True)
class JudgeTable:
    type: str = opt("judge", choices=("judge", "ruler"), help="judge (alias ruler): an OpenAI-compatible chat model")
    base_url: str = opt(REQUIRED, trajectory=False, help="the server's OpenAI API root, e.g. http://127.0.0.1:8080/v1")
    model: str = opt(REQUIRED, help="the model name sent with each request")
    api_key_env: str = opt("OPENAI_API_KEY", trajectory=False,
                           help="environment variable holding the API key (keys never go in the TOML); the default "
                                "may be unset for a local server")
    mode: str = opt("pointwise", choices=("pointwise", "listwise", "pairwise"),
                    help="pointwise: a 0-10 score per completion; listwise: a group's completions scored together; "
                         "pairwise: win rates of pairs")
    rubric: Optional[str] = opt(None, help="what the judge looks for (a prompt row's \"rubric\" field overrides it)")
    listwise_orders: int = opt(2, min=1, max=16, help="listwise: permuted orders per group, averaged")
    both_orders: bool = opt(True, help="pairwise: ask every pair as A/B and B/A")
    max_pairs: int = opt(0, min=0, help="pairwise: at most this many pairs per group (0: all)")
    temperature: float = opt(0.0, min=0, help="the judge's sampling temperature")
    max_tokens: int = opt(256, min=1, help="the judge's reply length limit")
    structured_output: bool = opt(True, help="send the reply's JSON schema as response_format")
    max_concurrency: int = opt(4, min=1, max=256, trajectory=False, help="requests in flight")
    timeout_seconds: float = opt(120.0, min=0, min_exclusive=True, trajectory=False,
                                 help="deadline of one request (a slow server is cut off there)")
    max_retries: int = opt(2, min=0, max=20, trajectory=False, help="retries of a failed request")
    cache_path: Optional[str] = opt(None, path=True, trajectory=False,
                                    help="a JSON-lines cache of replies (default: judge-cache.jsonl in the run folder)")


GRPO_SUBTABLES = {"sampling": GrpoSamplingTable, "overlong_penalty": GrpoOverlongTable,
                  "kl_schedule": GrpoKlScheduleTable, "dynamic_sampling": GrpoDynamicSamplingTable}


@dataclass(frozen=True)
class PpoCriticTable:
    enabled: bool = opt(True, help="a critic and GAE advantages; false: whitened sequence rewards on every token")
    critic: str = opt("head", choices=("head", "model"),
                      help="head: a value head on the policy's final hidden states (a linear probe, no forward of "
                           "its own); model: a separate value model (critic.model, with a LoRA of critic.rank)")
    model: Optional[str] = opt(None, trajectory=False,
                               help="critic = \"model\": the value model (HF folder, .gguf or alias; same tokenizer)")
    rank: int = opt(8, min=1, max=512, help="critic = \"model\": LoRA rank of the value model")
    gamma: float = opt(1.0, min=0, max=1, help="discount of GAE")
    gae_lambda: float = opt(0.95, min=0, max=1, help="GAE's lambda (TD(lambda) returns)")
    value_lr: float = opt(0.01, min=0, min_exclusive=True, help="learning rate of the critic")
    value_epochs: int = opt(8, min=1, help="full-batch critic steps per update")
    feature_dtype: str = opt("f32", choices=("f32", "f16", "bf16"), help="storage dtype of the critic's features")


@dataclass(frozen=True)
class PpoTable:
    prompts: str = opt(REQUIRED, path=True, trajectory=False,
                       help='prompt rows: .jsonl {"messages": [...]} or {"prompt": ...} plus reward columns, or builtin:NAME')
    updates: Optional[int] = opt(None, min=1, help="policy updates (default: training.max_steps, else one pass "
                                                   "over the prompts x training.epochs)")
    rollout_batch_size: int = opt(8, min=1, help="prompts per update, one completion each")
    ppo_epochs: int = opt(2, min=1, help="optimizer steps per update on the same rollouts")
    clip_range: float = opt(0.2, min=0, max=1, min_exclusive=True, max_exclusive=True,
                            help="ratio clip [1 - clip_range, 1 + clip_range_high]")
    clip_range_high: Optional[float] = opt(None, min=0, help="the upper band (Clip-Higher); default clip_range")
    clip_ratio_c: float = opt(3.0, min=0, help="dual-clip: an A < 0 token's objective is at most c |A| (0: off; else > 1)")
    kl_coefficient: float = opt(0.0, min=0, help="weight of the k3 KL toward the rollout policy (the one that sampled)")
    loss_normalisation: str = opt("token", choices=("token", "constant", "sequence"),
                                  help="token: / tokens; constant: / (completions x max_new_tokens); sequence: per-completion mean")
    mask_truncated: bool = opt(False, help="leave out of the loss completions that hit max_new_tokens")
    prompt_order: str = opt("shuffled", choices=("sequential", "shuffled"), help="order prompts are taken in")
    rewards: list = opt([], help="reward functions, as [[grpo.rewards]]: [[ppo.rewards]] tables")
    reward_command: Optional[list] = opt(None, trajectory=False,
                                         help="argv of a retrograd-reward/1 program (added to the rewards, weight 1)")
    reward_mode: str = opt("persistent", choices=("persistent", "oneshot"), help="reward_command mode")
    reward_timeout_seconds: float = opt(300.0, min=0, min_exclusive=True, trajectory=False,
                                        help="most seconds a reward batch may take")
    log_completions_every: int = opt(1, min=0, trajectory=False,
                                     help="write sampled completions to completions.jsonl every N updates (0: never)")
    template_variables: dict = opt({}, help="extra variables passed to the chat template")
    sampling: dict = opt({}, help="[ppo.sampling]: max_new_tokens, temperature, top_p, top_k, seed, stop, dtype")
    critic: dict = opt({}, help="[ppo.critic]: enabled, critic, gamma, gae_lambda, value_lr, value_epochs, feature_dtype")
    overlong_penalty: Optional[dict] = opt(None, help="[ppo.overlong_penalty]: buffer_tokens, max_penalty")
    judge: Optional[dict] = opt(None, help="[ppo.judge]: an OpenAI-compatible LLM judge as one more reward")
    judge_weight: Optional[float] = opt(None, help="with a judge (required): reward + judge_weight x verdict in [0, 1]")
    judge_failure: str = opt("drop_group", choices=("drop_group", "fail"),
                             help="a group the judge fails on: left out of the update, or the run stops")
    max_judge_dropped_fraction: float = opt(0.5, min=0, max=1,
                                            help="stop when the judge fails on more of an update's groups than this")


@dataclass(frozen=True)
class DistillTable:
    mode: str = opt("on_policy", choices=("on_policy", "topk_offline"),
                    help="on_policy: the student samples, the teacher scores every sampled token; topk_offline: "
                         "forward KL on the teacher's top-k log-probs written once by `retrograd distill-teacher`")
    teacher_path: str = opt(REQUIRED, trajectory=False,
                            help="the teacher (HF folder, .gguf or alias); the same tokenizer as the student")
    # ---- on_policy ----
    prompts: Optional[str] = opt(None, path=True, trajectory=False,
                                 help="on_policy: prompt rows (as [grpo] prompts; chat rows may end on assistant "
                                      "turns, which are left out: SFT data works as is)")
    updates: Optional[int] = opt(None, min=1, help="on_policy: updates (default training.max_steps, else one pass)")
    prompts_per_update: Optional[int] = opt(None, min=1, help="on_policy: prompts per update (4)")
    samples_per_prompt: Optional[int] = opt(None, min=1, max=256, help="on_policy: completions per prompt (1)")
    distill_epochs: Optional[int] = opt(None, min=1, help="on_policy: optimizer steps per update (1)")
    clip_range_low: Optional[float] = opt(None, min=0, max=1, help="on_policy: ratio clip below 1 (0.2; distill_epochs > 1)")
    clip_range_high: Optional[float] = opt(None, min=0, help="on_policy: ratio clip above 1 (0.28; distill_epochs > 1)")
    weight_clip: Optional[float] = opt(None, min=0, min_exclusive=True,
                                       help="on_policy: per-token advantage log p_T - log p_S clamped to +-this (5.0 nats)")
    kl_coefficient: Optional[float] = opt(None, min=0, help="on_policy: k3 KL toward the base (the adapter disabled), 0")
    mask_truncated: Optional[bool] = opt(None, help="on_policy: leave out completions that hit max_new_tokens (false)")
    prompt_order: Optional[str] = opt(None, choices=("sequential", "shuffled"), help="on_policy: prompt order (shuffled)")
    sampling: Optional[dict] = opt(None, help="on_policy: [distill.sampling] (as [grpo.sampling])")
    log_completions_every: int = opt(1, min=0, trajectory=False, help="on_policy: completions.jsonl every N updates")
    # ---- topk_offline ----
    data: Optional[str] = opt(None, path=True, trajectory=False,
                              help="topk_offline: the rows the teacher scored (chat / prompt-completion / text, as [sft])")
    sidecar: Optional[str] = opt(None, path=True, trajectory=False,
                                 help="topk_offline: the .topk file `retrograd distill-teacher` wrote")
    offline_epochs: Optional[int] = opt(None, min=1, help="topk_offline: passes over the data (1)")
    template_variables: dict = opt({}, help="extra variables passed to the chat template")


DISTILL_ON_POLICY = {"prompts": None, "updates": None, "prompts_per_update": 4, "samples_per_prompt": 1,
                     "distill_epochs": 1, "clip_range_low": 0.2, "clip_range_high": 0.28, "weight_clip": 5.0,
                     "kl_coefficient": 0.0, "mask_truncated": False, "prompt_order": "shuffled", "sampling": {}}
DISTILL_OFFLINE = {"data": None, "sidecar": None, "offline_epochs": 1}


PPO_SUBTABLES = {"sampling": GrpoSamplingTable, "critic": PpoCriticTable, "overlong_penalty": GrpoOverlongTable}


@dataclass(frozen=True)
class ReferenceTable:
    model: str = opt(REQUIRED, trajectory=False,
                     help="the reference model (HF folder, .gguf or alias; same tokenizer as the trained model); "
                          "scored once before the first step, never held during training")
    ctx: Optional[int] = opt(None, min=8, help="context of the reference (default training.ctx; must equal it here)")


@dataclass(frozen=True)
class EvaluationTable:
    data: str = opt(REQUIRED, path=True, trajectory=False, help="held-out data in the training format")
    every_steps: Optional[int] = opt(None, min=1, help="evaluate every N optimizer steps")
    every_iterations: Optional[int] = opt(None, min=1,
                                          help="evaluate every N epochs (SFT, preference, offline distill) or N "
                                               "updates (GRPO, PPO, on-policy distill), retrograd-rs's meaning")
    max_examples: Optional[int] = opt(None, min=1, help="evaluate on at most N rows, evenly spaced")
    patience: Optional[int] = opt(None, min=1, help="stop after N evaluations without improvement")
    min_delta: float = opt(0.0, min=0, help="smallest loss decrease that counts as an improvement")
    batch_size: Optional[int] = opt(None, min=1, trajectory=False,
                                    help="sequences per evaluation batch (default: training.batch_size)")


@dataclass(frozen=True)
class CheckpointTable:
    directory: str = opt(REQUIRED, path=True, trajectory=False, help="where .state checkpoints go")
    mode: str = opt(REQUIRED, choices=("steps", "best_eval", "steps_and_best_eval"), trajectory=False,
                    help="steps: every every_steps; best_eval: best.state; or both")
    every_steps: Optional[int] = opt(None, min=1, trajectory=False,
                                     help="optimizer steps between checkpoints (step modes)")
    resume_from: Optional[str] = opt(None, path=True, trajectory=False,
                                     help="checkpoint to resume from (same as --resume PATH)")


@dataclass(frozen=True)
class BackpressureTable:
    enabled: bool = opt(False, help="choose GRPO's prompts per update from a USL fit of throughput vs concurrency")
    warmup_steps: int = opt(10, min=0, help="updates that sweep the batch sizes 1, 2, 4, ... max_batch_size first")
    ema_decay: float = opt(0.9, min=0, max=1, max_exclusive=True, help="smoothing of the measured throughput")
    throttle_margin: float = opt(0.85, min=0, max=1, min_exclusive=True, help="target = this x the peak concurrency")
    increase_margin: float = opt(0.5, min=0, max=1, help="'increase' below this share of the target")
    min_batch_size: int = opt(1, min=1, help="fewest prompts per update")
    max_batch_size: int = opt(64, min=1, help="most prompts per update")


@dataclass(frozen=True)
class DistributedTable:
    strategy: str = opt("auto", choices=("auto", "none", "ddp", "fsdp2"), trajectory=False,
                        help="with several processes (torchrun, --nproc): ddp = every rank holds the model and "
                             "works on its share of each step, gradients all-reduced (the update equals one "
                             "process's); fsdp2 = the same with weights and optimizer state sharded (every "
                             "algorithm; the RL loops sample from the weights gathered whole; with a LoRA the "
                             "frozen base is sharded too); auto = fsdp2 for full fine-tunes, ddp for a LoRA; "
                             "none = refuse several processes")
    mixed_precision: str = opt("none", choices=("none", "bf16"),
                               help="fsdp2: bf16 = layers compute in bfloat16 (gathered weights cast, half the "
                                    "communication) while the sharded weights, optimizer and gradient reduction stay "
                                    "float32; on a CPU without native bf16 it is slower, and the run says so")


@dataclass(frozen=True)
class MetricsTable:
    tensorboard_dir: Optional[str] = opt(None, path=True, trajectory=False,
                                         help="write TensorBoard event files in one subfolder per run")
    log_every: int = opt(1, min=1, trajectory=False, help="print a progress line every N steps")
    wandb_export_dir: Optional[str] = opt(None, path=True, trajectory=False,
                                          help="write an offline W&B export (no network, no wandb import); upload "
                                               "it with scripts/import_wandb.py")


@dataclass(frozen=True)
class RunConfig:
    """The whole validated config. `source` is the TOML path; paths inside are already absolute."""
    run: RunTable
    model: ModelTable
    output: OutputTable
    training: TrainingTable
    lora: Optional[LoraTable] = None
    sft: Optional[SftTable] = None
    preference: Optional[PreferenceTable] = None
    grpo: Optional[GrpoTable] = None
    ppo: Optional[PpoTable] = None
    distill: Optional[DistillTable] = None
    reference: Optional[ReferenceTable] = None
    evaluation: Optional[EvaluationTable] = None
    checkpoint: Optional[CheckpointTable] = None
    backpressure: Optional[BackpressureTable] = None
    distributed: DistributedTable = field(default_factory=DistributedTable)
    metrics: MetricsTable = field(default_factory=MetricsTable)
    source: str = ""


# table name -> dataclass; the order is the order of the docs and the JSON schema
TABLES: dict[str, type] = {
    "run": RunTable, "model": ModelTable, "output": OutputTable, "lora": LoraTable,
    "training": TrainingTable, "sft": SftTable, "preference": PreferenceTable, "grpo": GrpoTable, "ppo": PpoTable,
    "distill": DistillTable,
    "reference": ReferenceTable,
    "evaluation": EvaluationTable,
    "checkpoint": CheckpointTable, "metrics": MetricsTable, "backpressure": BackpressureTable,
    "distributed": DistributedTable,
}
# tables of algorithms this version does not run yet: named so the error can say so
ALGORITHM_TABLES = {"sft": "sft", "preference": "preference", "ppo": "ppo", "grpo": "grpo",
                    "distill": "distill", "agent": "agent_grpo"}

# keys that retrograd-rs users bring, with what to write here instead
FOREIGN_KEYS = {
    "training.chunked_cross_entropy": "retrograd always computes the loss in vocabulary-sized chunks without "
                                      "full logits; remove the key",
    "training.kv_dtype": "the training attention cache dtype follows model.dtype here; remove the key",
}


def table_fields(cls) -> dict:
    return {f.name: f for f in fields(cls)}
