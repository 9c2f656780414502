"""Tiny random models of every family dpa supports, built from configs (no download, a few ms each).

The test suite, the self-test (``python -m dpa selftest``) and the book build their tiny models here, so that
"every family" means the same models everywhere. Each is small (hidden 32, 3 layers, 4 heads) but keeps what
makes its family its family: Mistral's sliding window, Gemma's local layer and soft-caps, SmolLM3's NoPE layer,
Phi-3's and GPT-NeoX's partial rotary, four experts with two per token, GPT-OSS's sinks and clamped GLU.
"""

from __future__ import annotations

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "smollm3", "olmo2", "phi3", "gpt2",
            "gpt_neox", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
MHA_ONLY = ("gpt2", "gpt_neox", "mamba2", "mamba", "falcon_mamba")  # families whose configs have no KV-head setting
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "granitemoehybrid", "qwen3_next", "jamba",
                "nemotron_h")
# Hybrid families: token mixers other than attention on some layers (book: Beyond attention). dpa.attribute covers
# them; what reads attention probabilities (attention maps, head ablations) refuses their mixer layers by name.
HYBRID_FAMILIES = ("lfm2", "bamba", "granitemoehybrid", "jamba", "mamba2", "mamba", "falcon_mamba",  # (the Mamba
                   "qwen3_next", "nemotron_h")  # families: no attention, no MLP)
SCAN_FAMILIES = ("bamba", "granitemoehybrid", "jamba", "mamba2", "mamba", "falcon_mamba", "qwen3_next",  # with
                 "nemotron_h")
# Mamba-2 blocks (ssd.py), Mamba's (selective.py) or Gated DeltaNets (delta.py): dpa's own Function
PARALLEL_FAMILIES = ("falcon_h1",)  # a Mamba-2 block beside attention on every layer (Family.beside): dpa.attribute
# covers them (tests/test_falcon_h1.py); what sums writes itself (circuit graphs, MIB, the lens) refuses them by name
SELECTIVE_FAMILIES = ("jamba", "mamba", "falcon_mamba")  # Mamba's blocks: MIB's graph cannot feed their readers apart
LAYOUTS = {"mha": 4, "gqa": 2, "mqa": 1}  # KV heads for 4 query heads


def config_class(family: str):
    import transformers

    from .families import FAMILIES as DESCRIPTIONS

    return getattr(transformers, DESCRIPTIONS[family].config_class)


def tiny_config(family: str, kv_heads: int = 2, **overrides):
    """The family's config with tiny sizes (``overrides`` last)."""
    kwargs = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=kv_heads, max_position_embeddings=64, rms_norm_eps=1e-2, head_dim=8)
    if family == "mistral":
        kwargs["sliding_window"] = 5  # short enough to matter on the test prompts
    if family == "qwen2":
        kwargs.pop("head_dim")
    if family == "smollm3":  # the middle layer without RoPE (NoPE), as every fourth in SmolLM3
        kwargs.update(no_rope_layers=[1, 0, 1], pad_token_id=0, bos_token_id=1, eos_token_id=2)
        kwargs.pop("head_dim")  # SmolLM3 derives it (32 / 4 = 8, as for the others)
    if family == "olmo2":  # derives head_dim (32 / 4 = 8)
        kwargs.pop("head_dim")
        kwargs.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family in ("gemma3_text", "gemma2"):  # a local (sliding) layer between global ones; 1/sqrt(6) scaling
        kwargs.update(sliding_window=5, layer_types=["full_attention", "sliding_attention", "full_attention"],
                      query_pre_attn_scalar=6, pad_token_id=0)
    if family == "gemma2":  # soft-caps small enough to matter on tiny random weights
        kwargs.update(attn_logit_softcapping=1.5, final_logit_softcapping=2.0, bos_token_id=1, eos_token_id=2)
    if family == "phi3":  # derives head_dim; a rotary half of each head (partial_rotary_factor, as Phi-4-mini)
        kwargs.pop("head_dim")
        kwargs.update(pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    if family in MOE_FAMILIES[:5]:  # four experts, two per token; Qwen2-MoE's shared expert; both router kinds
        kwargs.update(num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        kwargs["num_local_experts" if family == "mixtral" else "num_experts"] = 4
        if family not in ("mixtral", "gpt_oss"):
            kwargs.update(norm_topk_prob=family == "qwen3_moe")
        if family in ("qwen2_moe", "qwen3_moe"):
            kwargs.update(moe_intermediate_size=12)
        if family == "qwen2_moe":
            kwargs.update(shared_expert_intermediate_size=16)
            kwargs.pop("head_dim")
        if family == "olmoe":
            kwargs.pop("head_dim")
            kwargs.update(intermediate_size=12)
        if family == "gpt_oss":  # sliding and full layers, attention sinks, biases; a limit small enough to clamp
            kwargs.pop("num_experts")
            kwargs.update(num_local_experts=4, intermediate_size=12, swiglu_limit=0.3, sliding_window=5,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family in HYBRID_FAMILIES + PARALLEL_FAMILIES:
        kwargs = _hybrid(family, kwargs)
    if family == "gpt2":
        kwargs = dict(vocab_size=96, n_embd=32, n_inner=48, n_layer=3, n_head=4, n_positions=64,
                      bos_token_id=1, eos_token_id=2, layer_norm_epsilon=1e-2)
    if family == "gpt_neox":  # partial rotary (a quarter of each head, Pythia's), parallel residuals
        kwargs.pop("head_dim"), kwargs.pop("num_key_value_heads"), kwargs.pop("rms_norm_eps")
        kwargs.update(layer_norm_eps=1e-2, bos_token_id=1, eos_token_id=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    kwargs.update(overrides)
    return config_class(family)(**kwargs)


def _hybrid(family: str, kwargs: dict) -> dict:
    """``tiny_config``'s sizes for a hybrid family (book: Beyond attention), from the common ``kwargs``."""
    if family == "lfm2":  # convolution layers around an attention layer; the MLP's width as given (no auto-adjust)
        kwargs.pop("head_dim"), kwargs.pop("rms_norm_eps")
        kwargs.update(norm_eps=1e-2, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3,
                      block_auto_adjust_ff_dim=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "bamba":  # Mamba-2 blocks around an attention layer: 4 SSM heads of 16 channels in 2 groups, chunks
        kwargs.pop("head_dim")  # of 4 positions (so prompts span several), the convolution's bias; partial RoPE
        kwargs.update(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
                      mamba_d_conv=4, mamba_chunk_size=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "granitemoehybrid":  # Bamba's blocks; four experts, two per token, and the dense MLP beside them
        kwargs.pop("head_dim")  # (Granite 4.0-H Tiny's layout; num_local_experts=0: the dense models); Granite's
        # multipliers away from one (and attention's scale from 1/sqrt(head_dim)); no RoPE, as the released models
        kwargs.update(layer_types=["linear_attention", "attention", "linear_attention"], num_local_experts=4,
                      num_experts_per_tok=2, intermediate_size=12, shared_intermediate_size=16, mamba_n_heads=4,
                      mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=4,
                      embedding_multiplier=1.7, residual_multiplier=0.6, logits_scaling=2.5, attention_multiplier=0.3,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "mamba2":  # three Mamba-2 blocks and no MLP: 4 SSM heads of 16 channels in 2 groups, chunks of 4
        kwargs = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_heads=4, head_dim=16, expand=2,
                      n_groups=2, state_size=8, conv_kernel=4, chunk_size=4, layer_norm_epsilon=1e-2,
                      residual_in_fp32=False, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)  # (residual_in_fp32 would cast a float64 model's residual to float32)
    if family == "jamba":  # Mamba blocks around an attention layer (no position embedding): 64 channels in 4 units of
        kwargs.pop("head_dim")  # 16, states of 8, a step of rank 4; four experts, two per token, on the Mamba layers,
        kwargs.update(attn_layer_period=2, attn_layer_offset=1, num_experts=4, num_experts_per_tok=2,  # a dense MLP
                      expert_layer_period=2, expert_layer_offset=0, mamba_d_state=8, mamba_d_conv=4,  # on the other
                      mamba_expand=2, mamba_dt_rank=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # (num_experts
        # 1: every layer dense)
    if family == "qwen3_next":  # Gated DeltaNets around a gated attention layer: 2 key heads of 8, each read by 2
        kwargs.update(layer_types=["linear_attention", "full_attention", "linear_attention"],  # value heads of 8 (a
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,  # unit each), a
                      linear_value_head_dim=8, linear_conv_kernel_dim=3, num_experts=4,  # convolution of 3; four
                      num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=16,  # experts,
                      norm_topk_prob=True, mlp_only_layers=[1], pad_token_id=0, bos_token_id=1,  # two per token, a
                      eos_token_id=2)  # gated shared expert, a dense MLP on the attention layer (mlp_only_layers;
        # num_experts=0: every layer dense); a quarter of each head rotated (its default)
    if family == "nemotron_h":  # one block per layer: a Mamba-2 block (4 SSM heads of 16 channels in 2 groups, chunks
        kwargs.pop("rms_norm_eps")  # of 4, the convolution's bias), a squared-ReLU MLP, an attention layer (no
        kwargs.update(layers_block_type=["linear_attention", "mlp", "full_attention", "moe"], mamba_num_heads=4,
                      mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=4,  # RoPE), and
                      layer_norm_epsilon=1e-2, pad_token_id=0, bos_token_id=1, eos_token_id=2,  # Nemotron 3's
                      n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,  # sparse block: four
                      moe_shared_expert_intermediate_size=16, moe_latent_size=16, n_group=2, topk_group=1,  # experts
                      norm_topk_prob=True, routed_scaling_factor=1.7)  # of 12 in a latent space of 16, two per
        # token from one group of two, a shared expert of 16
    if family == "falcon_h1":  # attention (4 heads of 8) and a Mamba-2 block (4 SSM heads of 16 channels in 2 groups,
        kwargs.pop("head_dim")  # chunks of 4, the convolution's bias, no gated norm as released) side by side on
        kwargs.update(mamba_n_heads=4, mamba_d_ssm=64, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,  # every
                      mamba_chunk_size=4, key_multiplier=0.7, attention_in_multiplier=1.3,  # layer; every µP
                      attention_out_multiplier=0.8, ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,  # scalar away
                      ssm_multipliers=[0.9, 1.1, 0.8, 1.3, 0.7], mlp_multipliers=[1.4, 0.6],  # from one
                      embedding_multiplier=1.5, lm_head_multiplier=0.7, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    if family in ("mamba", "falcon_mamba"):  # three Mamba blocks and no MLP: 64 channels (each a unit) with states of
        kwargs = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, expand=2, state_size=8,  # 8, a step of
                      conv_kernel=4, time_step_rank=4, layer_norm_epsilon=1e-2, residual_in_fp32=False,  # rank 4
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        if family == "falcon_mamba":  # its norms of the step's input, B and C, with an eps that matters
            kwargs.update(mixer_rms_eps=1e-2)
    return kwargs


def tiny_model(family: str, kv_heads: int = 2, seed: int = 0, dtype: torch.dtype = torch.float64, **overrides):
    """A model with every parameter random (norm gammas and biases too, so that they are exercised), in eval
    mode with ``requires_grad`` off. Mixtures of experts run transformers' eager experts (its default kernel
    has no float64 path). A norm's gamma is found by its module (every LayerNorm and RMSNorm, whatever its name:
    GPT-2's ``ln_1``), never drawn near zero like a projection's weight."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, kv_heads, **overrides)
    if family in MOE_FAMILIES:
        config._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    gains = {f"{name}.weight" for name, m in model.named_modules()
             if isinstance(m, torch.nn.LayerNorm) or type(m).__name__.endswith("RMSNorm")}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in gains:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    model.requires_grad_(False)
    return model


def random_ids(n: int, vocab: int = 96, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g)
