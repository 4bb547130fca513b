#!/usr/bin/env python3
"""Differential test of kvx's model reading and KV cache rules against vLLM 0.33.0's own code.

For many generated models (random configs of the architectures kvx reads, and random layer
patterns as kvx model TOMLs), at TP 1, 2, 4 and 8, with each GDN prefill backend and prefix
caching on and off, and with the hybrid KV cache manager on and off, it asks both sides what
an engine looks like and compares:

  vLLM  the config loaded through transformers' configuration class (defaults, legacy names,
        derived layer patterns, its validation), the layers each vLLM model file builds from it
        (the fields it reads, transcribed below with file:line), then vLLM's own functions:
        the model class's get_mamba_state_shape_from_config / get_mamba_state_dtype_from_config
        (MambaStateShapeCalculator), Platform._align_hybrid_block_size (block size and padded
        state page), the KV cache specs' page sizes, and get_kv_cache_groups (group formation,
        HMA on or off);
  kvx   `kvx layout --model-config FILE --tp N ... --format json`, its `engine` section (the
        terms of a hybrid oracle case's `p`), or its refusal (exit 2).

Compared: whether the engine exists (or both refuse), block size, page bytes, local KV heads,
every group's spec, window and layer names in order, the state's shapes and dtypes, its real
and padded page. Prints one line per disagreement and a summary; writes the summary as JSON
with --out. Exit 1 on any disagreement.

Needs a Python with vllm==0.33.0 and torch (CPU torch is enough), e.g.:
    python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm==0.33.0
    .venv-vllm/bin/python scripts/vllm-diff.py --kvx target/release/kvx --models 1200 --out results/docs/vllm-diff/summary.json
"""

import argparse
import contextlib
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
import types
from math import gcd

# The NixlConnector requires the DS conv state layout (it asserts it): shapes are
# (channels, kernel - 1), as in a P/D deployment.
os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
logging.disable(logging.WARNING)

import torch  # noqa: E402
import transformers  # noqa: E402
import vllm  # noqa: E402
from vllm.model_executor.layers.mamba import abstract as mamba_abstract  # noqa: E402
from vllm.model_executor.models.config import NemotronHForCausalLMConfig  # noqa: E402
from vllm.platforms.interface import Platform  # noqa: E402
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.core import kv_cache_planning  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

NS = types.SimpleNamespace
VLLM_VERSION = vllm.__version__
TORCH_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
TPS = (1, 2, 4, 8)


# ---------------------------------------------------------------------------------------------
# Model classes (vLLM's own, for their state shape and dtype class methods).

def model_class(arch):
    from vllm.model_executor.models import falcon_h1, granitemoehybrid, jamba, nemotron_h, qwen3_next

    return {
        "Qwen3NextForCausalLM": qwen3_next.Qwen3NextForCausalLM,
        "NemotronHForCausalLM": nemotron_h.NemotronHForCausalLM,
        "GraniteMoeHybridForCausalLM": granitemoehybrid.GraniteMoeHybridForCausalLM,
        "JambaForCausalLM": jamba.JambaForCausalLM,
        "FalconH1ForCausalLM": falcon_h1.FalconH1ForCausalLM,
    }.get(arch)


MAMBA_TYPE = {
    "mamba1": MambaAttentionBackendEnum.MAMBA1,
    "mamba2": MambaAttentionBackendEnum.MAMBA2,
    "gdn": MambaAttentionBackendEnum.GDN_ATTN,
}


# ---------------------------------------------------------------------------------------------
# The layers each vLLM model file builds from its (transformers-loaded) config: (name, kind,
# window) in construction order, kind in {"full", "swa", "mamba1", "mamba2", "gdn"}; and the
# attention shape it builds them with.

def hd(c, default_from_hidden=True):
    h = getattr(c, "head_dim", None)
    if h is None and default_from_hidden:
        return c.hidden_size // c.num_attention_heads
    return h


def vllm_layers(arch, c):
    n = c.num_hidden_layers
    if arch == "Qwen3NextForCausalLM":  # qwen3_next.py:668 layer_types; :504 linear_attn, :360 self_attn.attn
        out = []
        for i in range(n):
            t = c.layer_types[i]
            if t == "linear_attention":
                out.append((f"model.layers.{i}.linear_attn", "gdn", None))
            elif t == "full_attention":
                out.append((f"model.layers.{i}.self_attn.attn", "full", None))
            else:
                raise ValueError(f"layer type {t}")
        return out, (c.num_key_value_heads, c.head_dim or c.hidden_size // c.num_attention_heads)
    if arch == "NemotronHForCausalLM":  # nemotron_h.py:597 pattern; :405 mixer, :487 mixer.attn, :478 window
        out = []
        window = getattr(c, "sliding_window", None)
        for i, t in enumerate(c.hybrid_override_pattern):
            if t == "M":
                out.append((f"model.layers.{i}.mixer", "mamba2", None))
            elif t == "*":
                out.append((f"model.layers.{i}.mixer.attn", "swa" if window else "full", window))
        return out, (c.num_key_value_heads, hd(c))
    if arch == "GraniteMoeHybridForCausalLM":  # granitemoehybrid.py:350 layer_types; :87, :163+:293
        out = []
        for i in range(n):
            t = c.layer_types[i]
            if t == "linear_attention":
                out.append((f"model.layers.{i}.mixer", "mamba2", None))
            elif t == "full_attention":
                out.append((f"model.layers.{i}.self_attn.attn", "full", None))
            else:
                raise ValueError(f"layer type {t}")
        return out, (c.num_key_value_heads, c.hidden_size // c.num_attention_heads)  # :240
    if arch == "JambaForCausalLM":  # jamba.py:322 layers_block_type; :141 mixer, :237 attn
        out = []
        for i in range(n):
            t = c.layers_block_type[i]
            out.append((f"model.layers.{i}.mixer", "mamba1", None) if t == "mamba" else (f"model.layers.{i}.attn", "full", None))
        return out, (c.num_key_value_heads, c.hidden_size // c.num_attention_heads)  # :209
    if arch == "FalconH1ForCausalLM":  # falcon_h1.py:334 attention first, :343 ssm at num_layers + i
        out = []
        for i in range(n):
            out.append((f"model.layers.{i}.attn", "full", None))
            out.append((f"model.{n + i}.mixer", "mamba2", None))
        return out, (c.num_key_value_heads, hd(c))
    if arch == "GptOssForCausalLM":  # gpt_oss.py:175 even layers windowed; :443 attn + :185 attn
        out = [
            (f"model.layers.{i}.attn.attn", "swa" if i % 2 == 0 else "full", c.sliding_window if i % 2 == 0 else None)
            for i in range(n)
        ]
        return out, (c.num_key_value_heads, c.head_dim)
    if arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):  # gemma3.py:153 layer_types
        prefix = "language_model.model" if arch == "Gemma3ForConditionalGeneration" else "model"
        out = []
        for i in range(n):
            sliding = c.layer_types[i] == "sliding_attention"
            out.append((f"{prefix}.layers.{i}.self_attn.attn", "swa" if sliding else "full", c.sliding_window if sliding else None))
        return out, (c.num_key_value_heads, c.head_dim)
    if arch in ("LlamaForCausalLM", "MistralForCausalLM"):  # llama.py:186 layer_types windows
        lt = getattr(c, "layer_types", None)
        out = []
        for i in range(n):
            sliding = bool(lt) and lt[i] == "sliding_attention" and c.sliding_window is not None
            out.append((f"model.layers.{i}.self_attn.attn", "swa" if sliding else "full", c.sliding_window if sliding else None))
        return out, (c.num_key_value_heads, hd(c))
    if arch == "Qwen2ForCausalLM":  # qwen2.py:150 hidden_size // heads, whatever head_dim says
        return [(f"model.layers.{i}.self_attn.attn", "full", None) for i in range(n)], (c.num_key_value_heads, c.hidden_size // c.num_attention_heads)
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"):  # head_dim or hidden // heads
        return [(f"model.layers.{i}.self_attn.attn", "full", None) for i in range(n)], (c.num_key_value_heads, hd(c))
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        return [(f"model.layers.{i}.self_attn.attn", "mla", None) for i in range(n)], (1, c.kv_lora_rank + c.qk_rope_head_dim)
    raise ValueError(f"architecture {arch}")


# ---------------------------------------------------------------------------------------------
# vLLM's engine for one config, TP and settings.

def model_dtype(hf):
    """vLLM's `auto` dtype on CUDA: the config's, float32 (and none) downcast to bfloat16."""
    d = getattr(hf, "dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d)
    return torch.bfloat16 if d in (None, torch.float32) else d


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def vllm_engine(arch, hf, text, tp, gdn_prefill, prefix_caching, hma, pattern_state=None):
    """The engine vLLM 0.33 builds, in a case's `p` terms, or ("refused", why)."""
    layers, (kv_heads, head_size) = vllm_layers(arch, text) if pattern_state is None else pattern_state["layers"]
    dtype = model_dtype(hf) if pattern_state is None else pattern_state["dtype"]
    kinds = {k for _, k, _ in layers}
    state_kinds = kinds & {"mamba1", "mamba2", "gdn"}
    attn = [l for l in layers if l[1] in ("full", "swa", "mla")]
    if not attn:
        return ("refused", "attention-free")
    # ModelConfig.get_num_kv_heads: max(1, total // tp); loading divides heads (or TP).
    if "mla" in kinds:
        local = 1
    else:
        if (tp <= kv_heads and kv_heads % tp) or (tp > kv_heads and tp % kv_heads):
            return ("refused", "KV heads do not split over TP")
        local = max(1, kv_heads // tp)
    cache_config = NS(
        block_size=16,
        cache_dtype="auto",
        mamba_cache_dtype="auto",
        mamba_ssm_cache_dtype="auto",
        mamba_page_size_padded=None,
        mamba_block_size=None,
        mamba_cache_mode="align" if (prefix_caching and state_kinds) else "none",
        kv_cache_dtype_skip_layers=None,
        enable_prefix_caching=prefix_caching,
        use_replayssm=False,
        user_specified_block_size=False,
        get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC,
    )
    state = None
    if state_kinds:
        if not hma:
            return ("refused", "state needs the hybrid KV cache manager")
        (kind,) = state_kinds
        parallel = NS(tensor_parallel_size=tp, decode_context_parallel_size=1, prefill_context_parallel_size=1)
        model_config = NS(
            hf_config=hf,
            hf_text_config=text,
            dtype=dtype,
            use_mla=False,
            architecture=arch,
            get_num_kv_heads=lambda pc: local,
            get_head_size=lambda: head_size,
        )
        vcfg = NS(
            model_config=model_config,
            cache_config=cache_config,
            parallel_config=parallel,
            speculative_config=None,
            num_speculative_tokens=0,
            additional_config={},
            scheduler_config=NS(disable_hybrid_kv_cache_manager=False),
        )
        if pattern_state is None:
            cls = model_class(arch)
            if arch == "NemotronHForCausalLM":
                NemotronHForCausalLMConfig.update_mamba_ssm_cache_dtype(cache_config=cache_config, hf_config=hf)
            try:
                shapes = cls.get_mamba_state_shape_from_config(vcfg)
                dtypes = cls.get_mamba_state_dtype_from_config(vcfg)
            except (AssertionError, ValueError) as e:  # divide(), Mamba2's head and group checks
                return ("refused", f"state shapes: {e}")
            if kind == "mamba2":
                # MambaMixer2 (mamba_mixer2.py:316-320) refuses at load time.
                heads, groups = pattern_state_or(hf, text, arch)
                if heads % tp:
                    return ("refused", "TP must divide Mamba2 heads")
                if groups % tp and groups != 1:
                    return ("refused", "n_groups neither divisible by TP nor 1")
        else:
            try:
                shapes, dtypes = pattern_state["shapes"](tp)
            except (AssertionError, ValueError) as e:
                return ("refused", f"state shapes: {e}")
            if pattern_state.get("mixer2") and pattern_state["mixer2"](tp):
                return ("refused", pattern_state["mixer2"](tp))
        if shapes is None:
            return ("refused", "no state shapes")

        class Cls:
            @classmethod
            def get_mamba_state_shape_from_config(cls, _):
                return shapes

            @classmethod
            def get_mamba_state_dtype_from_config(cls, _):
                return dtypes

        checkpoint = 64 if (kind == "gdn" and gdn_prefill == "flashinfer" and cache_config.mamba_cache_mode == "align") else None
        from vllm.model_executor import models as vllm_models

        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(vllm_models.ModelRegistry, "resolve_model_cls", lambda *a, **k: (Cls, arch)))
            stack.enter_context(patched(mamba_abstract, "get_mamba_prefill_checkpoint_alignment", lambda _c: checkpoint))
            stack.enter_context(patched(Platform, "_find_non_ssm_backends", classmethod(lambda cls, _c: [FlashAttentionBackend])))
            Platform._align_hybrid_block_size.__func__(Platform, vcfg, FlashAttentionBackend)
        state = (kind, shapes, dtypes)
    block = cache_config.block_size
    specs = {}
    attention_page = None
    for name, kind, window in layers:
        if kind == "full":
            s = FullAttentionSpec(block_size=block, num_kv_heads=local, head_size=head_size, dtype=dtype)
        elif kind == "swa":
            s = SlidingWindowSpec(block_size=block, num_kv_heads=local, head_size=head_size, dtype=dtype, sliding_window=window)
        elif kind == "mla":
            s = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=head_size, dtype=dtype)
        else:
            s = MambaSpec(
                block_size=block,
                shapes=tuple(tuple(x) for x in state[1]),
                dtypes=tuple(state[2]),
                page_size_padded=cache_config.mamba_page_size_padded,
                mamba_type=MAMBA_TYPE[kind],
                mamba_cache_mode=cache_config.mamba_cache_mode,
            )
        if kind in ("full", "swa", "mla") and attention_page is None:
            attention_page = s.page_size_bytes
        specs[name] = s
    vcfg = NS(
        scheduler_config=NS(disable_hybrid_kv_cache_manager=not hma),
        attention_config=None,
        cache_config=cache_config,
    )
    try:
        groups = kv_cache_planning.get_kv_cache_groups(vcfg, specs)
    except (NotImplementedError, ValueError, AssertionError) as e:
        return ("refused", f"groups: {e}")
    out_groups = []
    for g in groups:
        spec = g.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            name, window = "SlidingWindowSpec", spec.sliding_window
        elif isinstance(spec, MambaSpec):
            name, window = "MambaSpec", None
        elif isinstance(spec, MLAAttentionSpec):
            name, window = "MLAAttentionSpec", None
        else:
            name, window = "FullAttentionSpec", None
        out_groups.append((name, window, list(g.layer_names)))
    eng = {
        "block_size_tokens": block,
        "page_bytes": attention_page,
        "local_kv_heads": local,
        "groups": out_groups,
    }
    if state:
        kind, shapes, dtypes = state
        real = MambaSpec(block_size=block, shapes=tuple(tuple(x) for x in shapes), dtypes=tuple(dtypes)).page_size_bytes
        eng["state"] = {
            "shapes": [list(x) for x in shapes],
            "dtypes": [TORCH_NAMES[d] for d in dtypes],
            "real": real,
            "padded": cache_config.mamba_page_size_padded or real,
        }
    return eng


def pattern_state_or(hf, text, arch):
    if arch == "NemotronHForCausalLM":
        return hf.mamba_num_heads, hf.n_groups
    return text.mamba_n_heads, text.mamba_n_groups


# ---------------------------------------------------------------------------------------------
# kvx's engine, from its `engine` section.

def kvx_engine(kvx, path, tp, gdn_prefill, prefix_caching, hma, is_toml):
    cmd = [kvx, "layout", "--model" if is_toml else "--model-config", path, "--tp", str(tp), "--format", "json"]
    if hma is False:
        cmd += ["--hma", "off"]
    hybrid_flags = []
    if gdn_prefill:
        hybrid_flags += ["--gdn-prefill", gdn_prefill]
    if not prefix_caching:
        hybrid_flags += ["--no-prefix-caching"]
    r = subprocess.run(cmd + hybrid_flags, capture_output=True, text=True, timeout=60)
    if r.returncode == 2 and hybrid_flags and "applies to hybrid models" in (r.stdout + r.stderr):
        # A uniform model: the hybrid switches do not apply, and its engine is the same.
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        if r.returncode != 2:
            return ("crashed", f"exit {r.returncode}: {r.stderr.strip()[-300:]}")
        return ("refused", (r.stdout.strip() or r.stderr.strip())[-300:])
    doc = json.loads(r.stdout)
    e = doc["engine"]
    groups = [(g["spec"], g.get("sliding_window"), g["layers"]) for g in e["groups"]]
    eng = {
        "block_size_tokens": e["block_size_tokens"],
        "page_bytes": e["page_bytes"],
        "local_kv_heads": e["local_kv_heads"],
        "groups": groups,
    }
    if "mamba_state_shapes_local" in e:
        eng["state"] = {
            "shapes": e["mamba_state_shapes_local"],
            "dtypes": e["mamba_state_dtypes"],
            "real": e["mamba_real_page_bytes"],
            "padded": e["mamba_page_size_padded"],
        }
    return eng


# ---------------------------------------------------------------------------------------------
# Generators.

def pick(rng, xs):
    return xs[rng.randrange(len(xs))]


def maybe(rng, cfg, key, value, p=0.85):
    """Set `key` most of the time; leave it out (the class default applies) otherwise."""
    if rng.random() < p:
        cfg[key] = value


def attn_fields(rng, cfg, heads_choices=(8, 12, 16, 32), kv_choices=(1, 2, 4, 8), head_dims=(64, 128, 256)):
    heads = pick(rng, heads_choices)
    kv = pick(rng, [k for k in kv_choices if heads % k == 0] or [1])
    head_dim = pick(rng, head_dims)
    maybe(rng, cfg, "num_attention_heads", heads)
    maybe(rng, cfg, "num_key_value_heads", kv)
    maybe(rng, cfg, "hidden_size", heads * head_dim)
    maybe(rng, cfg, "head_dim", head_dim, 0.6)
    maybe(rng, cfg, "torch_dtype", pick(rng, ["bfloat16", "float16", "float32"]), 0.9)


def gen_config(rng):
    arch = pick(
        rng,
        [
            "Qwen3NextForCausalLM", "Qwen3NextForCausalLM",
            "NemotronHForCausalLM", "NemotronHForCausalLM",
            "GraniteMoeHybridForCausalLM", "GraniteMoeHybridForCausalLM",
            "JambaForCausalLM", "JambaForCausalLM",
            "FalconH1ForCausalLM", "FalconH1ForCausalLM",
            "GptOssForCausalLM",
            "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
            "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM",
        ],
    )
    cfg = {"architectures": [arch]}
    n = rng.randint(1, 24)
    if arch == "Qwen3NextForCausalLM":
        cfg["model_type"] = "qwen3_next"
        maybe(rng, cfg, "num_hidden_layers", n, 0.9)
        n = cfg.get("num_hidden_layers", 48)
        if rng.random() < 0.5:
            cfg["layer_types"] = [pick(rng, ["linear_attention", "full_attention"]) for _ in range(n)]
        else:
            maybe(rng, cfg, "full_attention_interval", rng.randint(1, 6))
        attn_fields(rng, cfg, kv_choices=(1, 2, 4))
        maybe(rng, cfg, "linear_num_key_heads", pick(rng, [4, 8, 16]))
        maybe(rng, cfg, "linear_num_value_heads", pick(rng, [8, 16, 32, 48]))
        maybe(rng, cfg, "linear_key_head_dim", pick(rng, [64, 128]))
        maybe(rng, cfg, "linear_value_head_dim", pick(rng, [64, 128]))
        maybe(rng, cfg, "linear_conv_kernel_dim", pick(rng, [2, 3, 4]))
    elif arch == "NemotronHForCausalLM":
        cfg["model_type"] = "nemotron_h"
        pattern = "".join(pick(rng, "MM*-E") for _ in range(n))
        if rng.random() < 0.7:
            cfg["hybrid_override_pattern"] = pattern
        else:
            legacy = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
            cfg["layers_block_type"] = [legacy[c] if rng.random() < 0.5 else {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}[c] for c in pattern]
        attn_fields(rng, cfg)
        heads = pick(rng, [16, 32, 64, 128])
        maybe(rng, cfg, "mamba_num_heads", heads)
        maybe(rng, cfg, "mamba_head_dim", pick(rng, [32, 64]))
        maybe(rng, cfg, "ssm_state_size", pick(rng, [64, 128]))
        maybe(rng, cfg, "n_groups", pick(rng, [1, 2, 4, 8]))
        maybe(rng, cfg, "conv_kernel", pick(rng, [2, 4]))
        maybe(rng, cfg, "mamba_ssm_cache_dtype", pick(rng, ["float32", "bfloat16"]), 0.3)
    elif arch == "GraniteMoeHybridForCausalLM":
        cfg["model_type"] = "granitemoehybrid"
        cfg["num_hidden_layers"] = n
        names = pick(rng, [("mamba", "attention"), ("linear_attention", "full_attention")])
        cfg["layer_types"] = [names[0] if rng.random() < 0.75 else names[1] for _ in range(n)]
        heads = pick(rng, [8, 12, 16, 32])
        head = pick(rng, [64, 128])
        cfg["num_attention_heads"] = heads
        maybe(rng, cfg, "num_key_value_heads", pick(rng, [k for k in (1, 2, 4, 8) if heads % k == 0]))
        cfg["hidden_size"] = heads * head
        expand = pick(rng, [1, 2])
        cfg["mamba_expand"] = expand
        mheads = pick(rng, [h for h in (16, 24, 32, 48, 64) if (expand * heads * head) % h == 0])
        cfg["mamba_n_heads"] = mheads
        if rng.random() < 0.5:
            cfg["mamba_d_head"] = expand * heads * head // mheads
        maybe(rng, cfg, "mamba_d_state", pick(rng, [64, 128]))
        maybe(rng, cfg, "mamba_n_groups", pick(rng, [1, 2, 8]))
        maybe(rng, cfg, "mamba_d_conv", pick(rng, [2, 4]))
        maybe(rng, cfg, "torch_dtype", "bfloat16")
    elif arch == "JambaForCausalLM":
        cfg["model_type"] = "jamba"
        cfg["num_hidden_layers"] = n
        period = rng.randint(1, 9)
        cfg["attn_layer_period"] = period
        cfg["attn_layer_offset"] = rng.randint(0, period - 1)
        attn_fields(rng, cfg, head_dims=(64, 128))
        maybe(rng, cfg, "mamba_expand", pick(rng, [1, 2]))
        maybe(rng, cfg, "mamba_d_state", pick(rng, [8, 16]))
        maybe(rng, cfg, "mamba_d_conv", pick(rng, [2, 4]))
    elif arch == "FalconH1ForCausalLM":
        cfg["model_type"] = "falcon_h1"
        cfg["num_hidden_layers"] = n
        heads = pick(rng, [8, 12, 16])
        head = pick(rng, [64, 128])
        cfg["num_attention_heads"] = heads
        maybe(rng, cfg, "num_key_value_heads", pick(rng, [k for k in (1, 2, 4) if heads % k == 0]))
        cfg["hidden_size"] = heads * head
        maybe(rng, cfg, "head_dim", head, 0.5)
        mheads = pick(rng, [8, 16, 24])
        mhead = pick(rng, [64, 128])
        cfg["mamba_d_ssm"] = mheads * mhead
        cfg["mamba_n_heads"] = mheads
        cfg["mamba_d_head"] = mhead if rng.random() < 0.6 else "auto"
        maybe(rng, cfg, "mamba_d_state", pick(rng, [128, 256]))
        maybe(rng, cfg, "mamba_n_groups", pick(rng, [1, 2, 8]))
        maybe(rng, cfg, "mamba_d_conv", pick(rng, [2, 4]))
        maybe(rng, cfg, "torch_dtype", "bfloat16")
    elif arch == "GptOssForCausalLM":
        cfg["model_type"] = "gpt_oss"
        maybe(rng, cfg, "num_hidden_layers", n, 0.9)
        attn_fields(rng, cfg, head_dims=(64,))
        maybe(rng, cfg, "sliding_window", pick(rng, [64, 128, 200, 1024]))
    elif arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        text = {"model_type": "gemma3_text"}
        maybe(rng, text, "num_hidden_layers", n, 0.9)
        n = text.get("num_hidden_layers", 26)
        attn_fields(rng, text, heads_choices=(4, 8), kv_choices=(1, 2, 4), head_dims=(128, 256))
        # Gemma-3's class checks hidden_size % heads; keep the pair consistent.
        text["hidden_size"] = text.get("num_attention_heads", 8) * pick(rng, [128, 256, 320])
        maybe(rng, text, "sliding_window", pick(rng, [128, 512, 1024, 4096]))
        if rng.random() < 0.4:
            text["layer_types"] = [pick(rng, ["sliding_attention", "sliding_attention", "full_attention"]) for _ in range(n)]
        else:
            maybe(rng, text, "sliding_window_pattern", rng.randint(1, 7))
        if arch == "Gemma3ForCausalLM":
            cfg.update(text)
        else:
            cfg["model_type"] = "gemma3"
            cfg["text_config"] = text
            cfg["torch_dtype"] = "bfloat16"
    elif arch == "DeepseekV3ForCausalLM":
        cfg["model_type"] = "deepseek_v3"
        cfg["num_hidden_layers"] = n
        attn_fields(rng, cfg)
        maybe(rng, cfg, "kv_lora_rank", pick(rng, [256, 512]))
        maybe(rng, cfg, "qk_rope_head_dim", pick(rng, [32, 64]))
    else:
        cfg["model_type"] = {
            "LlamaForCausalLM": "llama",
            "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3",
            "Qwen3MoeForCausalLM": "qwen3_moe",
        }[arch]
        cfg["num_hidden_layers"] = n
        attn_fields(rng, cfg)
        if arch in ("LlamaForCausalLM", "MistralForCausalLM") and rng.random() < 0.4:
            cfg["layer_types"] = [pick(rng, ["sliding_attention", "full_attention"]) for _ in range(n)]
            cfg["sliding_window"] = pick(rng, [256, 4096])
    return arch, cfg


def load_hf(arch, cfg):
    """The config as transformers (and so vLLM) loads it; raises when the class refuses it."""
    c = dict(cfg)
    model_type = c.pop("model_type")
    c.pop("architectures", None)
    hf = transformers.AutoConfig.for_model(model_type, **c)
    hf.architectures = [arch]
    text = hf.get_text_config() if arch == "Gemma3ForConditionalGeneration" else hf
    return hf, text


# A random layer pattern as a kvx model TOML, with vLLM's side built from the same pattern.

def gen_pattern(rng):
    n = rng.randint(1, 20)
    state = pick(rng, [None, "mamba1", "mamba2", "gdn"])
    windows = rng.sample([64, 128, 256, 1024], rng.randint(1, 3))
    kinds = ["full", "full"] + [f"swa:{w}" for w in windows] + ["mlp"]
    if state:
        kinds += [state, state, state, f"full+{state}"]
    layers = [pick(rng, kinds) for _ in range(n)]
    if not any(k.startswith(("full", "swa")) for k in layers):
        layers[rng.randrange(n)] = "full"
    heads = pick(rng, [1, 2, 4, 8])
    head_dim = pick(rng, [64, 128, 256])
    dtype = pick(rng, ["bf16", "fp16"])
    toml = [f'name = "pattern"', "layers = [" + ", ".join(f'"{k}"' for k in layers) + "]",
            f"[attention]\nnum_kv_heads = {heads}\nhead_dim = {head_dim}\ndtype = \"{dtype}\""]
    spec = None
    if state == "mamba1":
        spec = dict(kind="mamba1", intermediate_size=pick(rng, [512, 1024, 2048]), d_state=pick(rng, [8, 16]),
                    conv_kernel=pick(rng, [2, 4]), conv_dtype=dtype, ssm_dtype=pick(rng, [dtype, "fp32"]))
    elif state == "mamba2":
        nh = pick(rng, [8, 16, 32])
        spec = dict(kind="mamba2", num_heads=nh, head_dim=pick(rng, [32, 64]), d_state=pick(rng, [64, 128]),
                    n_groups=pick(rng, [g for g in (1, 2, 4, 8) if nh % g == 0]), conv_kernel=pick(rng, [2, 4]),
                    conv_dtype=dtype, ssm_dtype=pick(rng, [dtype, "fp32"]))
    elif state == "gdn":
        spec = dict(kind="gdn", num_k_heads=pick(rng, [4, 8, 16]), num_v_heads=pick(rng, [8, 16, 32]),
                    head_k_dim=pick(rng, [64, 128]), head_v_dim=pick(rng, [64, 128]), conv_kernel=pick(rng, [2, 4]),
                    conv_dtype=dtype, ssm_dtype=dtype)
    if spec:
        toml.append("[state]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in spec.items()))
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Calc

    def shapes(tp):
        s = spec
        if s["kind"] == "mamba1":
            sh = Calc.mamba1_state_shape(tp, s["intermediate_size"], s["d_state"], s["conv_kernel"])
        elif s["kind"] == "mamba2":
            sh = Calc.mamba2_state_shape(tp, s["num_heads"] * s["head_dim"], s["n_groups"], s["num_heads"], s["head_dim"], s["d_state"], s["conv_kernel"])
        else:
            sh = Calc.gated_delta_net_state_shape(tp, s["num_k_heads"], s["num_v_heads"], s["head_k_dim"], s["head_v_dim"], s["conv_kernel"])
        return sh, (torch_dtype[s["conv_dtype"]], torch_dtype[s["ssm_dtype"]])

    def mixer2(tp):
        if spec["kind"] != "mamba2":
            return None
        if spec["num_heads"] % tp:
            return "TP must divide Mamba2 heads"
        if spec["n_groups"] % tp and spec["n_groups"] != 1:
            return "n_groups neither divisible by TP nor 1"
        return None

    vlayers = []
    for i, k in enumerate(layers):
        for part in k.split("+"):
            if part == "full":
                vlayers.append((f"model.layers.{i}.self_attn.attn", "full", None))
            elif part.startswith("swa:"):
                vlayers.append((f"model.layers.{i}.self_attn.attn", "swa", int(part[4:])))
            elif part in ("mamba1", "mamba2", "gdn"):
                vlayers.append((f"model.layers.{i}.mixer", part, None))
    pattern_state = {
        "layers": (vlayers, (heads, head_dim)),
        "dtype": torch_dtype[dtype],
        "shapes": shapes if spec else None,
        "mixer2": mixer2 if spec else None,
    }
    return "\n".join(toml) + "\n", pattern_state, layers


# ---------------------------------------------------------------------------------------------

def differences(want, got):
    """What differs, field by field, in words."""
    if isinstance(want, tuple) or isinstance(got, tuple):
        return f"vllm {want if isinstance(want, tuple) else 'builds it'}; kvx {got if isinstance(got, tuple) else 'builds it'}"
    out = []
    for k in sorted(set(want) | set(got)):
        if k == "groups":
            wg, gg = want.get(k, []), got.get(k, [])
            if len(wg) != len(gg):
                out.append(f"groups: vllm {[(g[0], g[1], len(g[2])) for g in wg]} kvx {[(g[0], g[1], len(g[2])) for g in gg]}")
            else:
                for i, (a, b) in enumerate(zip(wg, gg)):
                    if list(a[:2]) != list(b[:2]) or list(a[2]) != list(b[2]):
                        out.append(f"group {i}: vllm {a[0]} {a[1]} {a[2][:6]} kvx {b[0]} {b[1]} {list(b[2])[:6]}")
        elif want.get(k) != got.get(k):
            out.append(f"{k}: vllm {want.get(k)} kvx {got.get(k)}")
    return "; ".join(out)


def norm(e):
    if isinstance(e, tuple):
        return ("refused",) if e[0] == "refused" else e
    e = dict(e)
    e["groups"] = [[g[0], g[1], list(g[2])] for g in e["groups"]]
    return e


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvx", required=True, help="the kvx binary")
    ap.add_argument("--models", type=int, default=1200, help="generated models (configs and patterns)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", help="write the summary here (JSON)")
    ap.add_argument("--max-disagreements", type=int, default=20, help="disagreements to print")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    started = time.time()
    stats = {"models": 0, "config_models": 0, "pattern_models": 0, "engines": 0, "engines_built": 0,
             "refusals_agreed": 0, "disagreements": 0, "class_refused_configs": 0, "by_architecture": {}}
    shown = 0
    examples = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in range(args.models):
            is_pattern = rng.random() < 0.3
            if is_pattern:
                toml, pstate, layers = gen_pattern(rng)
                path = os.path.join(tmp, f"pattern-{m}.toml")
                with open(path, "w") as f:
                    f.write(toml)
                arch, hf, text = "pattern", None, None
                stats["pattern_models"] += 1
            else:
                arch, cfg = gen_config(rng)
                pstate = None
                path = os.path.join(tmp, f"model-{m}")
                os.makedirs(path)
                with open(os.path.join(path, "config.json"), "w") as f:
                    json.dump(cfg, f)
                try:
                    hf, text = load_hf(arch, cfg)
                except Exception as e:  # transformers refuses the config: vLLM cannot load it
                    hf, text = None, str(e)
                stats["config_models"] += 1
            stats["models"] += 1
            per = stats["by_architecture"].setdefault(arch, {"models": 0, "engines": 0, "disagreements": 0})
            per["models"] += 1
            has_gdn = (text is not None and hf is not None and arch == "Qwen3NextForCausalLM") or (is_pattern and any("gdn" in l for l in layers))
            variants = [("flashinfer", True, True)]
            if has_gdn:
                variants += [("triton", True, True), ("flashinfer", False, True)]
            variants.append(("flashinfer", True, False))  # HMA off
            for tp in TPS:
                for gdn, pc, hma in variants:
                    if hf is None and not is_pattern:
                        want = ("refused", f"transformers: {text}")
                    else:
                        try:
                            want = vllm_engine(arch, hf, text, tp, gdn, pc, hma, pstate)
                        except Exception as e:  # noqa: BLE001 - a refusal inside vLLM's own code
                            want = ("refused", f"{type(e).__name__}: {e}")
                    got = kvx_engine(args.kvx, path, tp, gdn, pc, hma, is_pattern)
                    stats["engines"] += 1
                    per["engines"] += 1
                    if norm(want) == norm(got):
                        if isinstance(want, tuple):
                            stats["refusals_agreed"] += 1
                        else:
                            stats["engines_built"] += 1
                        continue
                    stats["disagreements"] += 1
                    per["disagreements"] += 1
                    if shown < args.max_disagreements:
                        shown += 1
                        src = open(path if is_pattern else os.path.join(path, "config.json")).read()
                        print(f"DISAGREE {arch} tp={tp} gdn={gdn} prefix_caching={pc} hma={hma}\n  config: {' '.join(src.split())[:700]}\n  {differences(want, got)[:1200]}", flush=True)
                        examples.append({"architecture": arch, "tp": tp, "config": src})
            if hf is None and not is_pattern:
                stats["class_refused_configs"] += 1
            if (m + 1) % 100 == 0:
                print(f"... {m + 1} models, {stats['engines']} engines, {stats['disagreements']} disagreements", flush=True)
    stats["seconds"] = round(time.time() - started, 1)
    summary = {
        "what": "kvx layout against vLLM 0.33.0's own functions on generated models (scripts/vllm-diff.py)",
        "command": " ".join(["scripts/vllm-diff.py"] + sys.argv[1:]),
        "vllm": VLLM_VERSION,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seed": args.seed,
        "tps": list(TPS),
        **stats,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
    return 1 if stats["disagreements"] else 0


if __name__ == "__main__":
    sys.exit(main())
