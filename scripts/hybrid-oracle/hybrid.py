"""Hybrid-model ground-truth cases (Mamba1 / Mamba2 / GDN state layers next to attention, and
sliding-window + full attention) from vLLM 0.33.0's own NIXL connector code (pull mode), run over
address-only tensors and a recording NIXL.

Re-expressed from vLLM's rules (not run): KV cache group formation
(_get_kv_cache_groups_uniform_page_size), Mamba state shapes (MambaStateShapeCalculator),
the hybrid block-size alignment (Platform._align_hybrid_block_size), and the layer-outer
LBHNC allocation (get_kv_cache_config_from_groups + allocate_kv_cache).
Run from vLLM's files: the schedulers (request_finished / get_num_new_matched_tokens /
update_state_after_alloc clipping), the workers (register_kv_caches, handshake payload,
add_remote_agent, TP mapping, start_load_kv and the posted READs), derive_mamba_conv_split.

The import harness is the shared one (<shared>/vllm-peer: stubs.py, v033.py, fake_nixl.py,
fake_tensor.py), used unchanged; what hybrid models need on top of it is added here at run
time (see _extend_harness). Paths:
  KVX_SHARED_DIR  folder holding vllm-peer/ and oracle/   (default: <repo root>/../shared)
  VLLM_033_SRC    unpacked vllm==0.33.0 wheel, .../vllm  (default: <repo root>/.vllm-033/vllm,
                  which scripts/setup-peers.sh creates)
"""
import dataclasses
import enum
import json
import math
import os
import sys
import traceback
from types import SimpleNamespace as NS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # scripts/hybrid-oracle/ -> repository root
SHARED = os.path.abspath(os.environ.get("KVX_SHARED_DIR") or os.path.join(ROOT, "..", "shared"))
PEER = os.path.join(SHARED, "vllm-peer")
os.environ.setdefault("VLLM_033_SRC", os.path.join(ROOT, ".vllm-033", "vllm"))
for _p, _what in ((os.path.join(PEER, "v033.py"), "KVX_SHARED_DIR (folder holding vllm-peer/)"),
                  (os.environ["VLLM_033_SRC"], "VLLM_033_SRC (unpacked vllm==0.33.0: .../vllm)")):
    if not os.path.exists(_p):
        sys.exit(f"hybrid.py: {_p} not found; set {_what}")
sys.path.insert(0, PEER)

import numpy as np  # noqa: E402

import stubs  # noqa: E402


# ----------------------------------------------------------------------------- harness extension
class MambaAttentionBackendEnum(enum.Enum):
    """Stand-in for vllm.v1.attention.backends.registry's enum (only identity matters)."""
    MAMBA1 = "MAMBA1"
    MAMBA2 = "MAMBA2"
    SHORT_CONV = "SHORT_CONV"
    LINEAR = "LINEAR"
    GDN_ATTN = "GDN_ATTN"


class RequestStatus(enum.Enum):
    """Stand-in for vllm.v1.request.RequestStatus (the members the schedulers look at)."""
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH_CAPPED = 3
    FINISHED_ABORTED = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridMambaSpec(stubs.MambaSpec):
    """The shared MambaSpec stub plus the fields the connector reads from a state spec."""
    shapes: tuple = ()
    dtypes: tuple = ()
    page_size_padded: object = None
    mamba_type: object = None
    num_speculative_blocks: int = 0
    tp_replicated: bool = False


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1,
                "uint8": 1, "int8": 1, "int32": 4, "int64": 8}


class _DtypeProbe:
    """What torch.tensor([], dtype=d) is used for here: its element_size()."""

    def __init__(self, dtype):
        self._dtype = dtype

    def element_size(self):
        return _DTYPE_BYTES[self._dtype]


def _size_numel(size):
    return math.prod(int(d) for d in size)


def _extend_harness():
    """Add, before v033 imports vLLM's files: one more real file (ssm_conv_transfer_utils.py, so
    derive_mamba_conv_split runs as vLLM's code), torch.Size.numel / torch.tensor / float32 /
    int8, KVCacheSpec.prefix_replay_tokens, MambaSpec's state fields, and the few vLLM names the
    hybrid paths import (backend enum, RequestStatus, DS conv-state layout)."""
    stubs._TorchSize.numel = _size_numel
    stubs.KVCacheSpec.prefix_replay_tokens = 0  # class default, read by the scheduler
    stubs.MambaSpec = HybridMambaSpec  # picked up by install() for vllm.v1.kv_cache_interface

    torch_stub = stubs.make_torch_stub

    def make_torch_stub():
        d = torch_stub()
        d.update(float32="float32", int8="int8", tensor=lambda data, dtype=None, **k: _DtypeProbe(dtype))
        return d

    stubs.make_torch_stub = make_torch_stub

    install = stubs.install
    ssm_file = os.path.join(os.environ["VLLM_033_SRC"], "distributed", "kv_transfer", "kv_connector",
                            "v1", "ssm_conv_transfer_utils.py")
    more = {
        "vllm.model_executor.layers.mamba.mamba_utils": {"is_conv_state_dim_first": lambda: True},
        "vllm.v1.attention.backends.registry": {"MambaAttentionBackendEnum": MambaAttentionBackendEnum},
        "vllm.v1.request": {"RequestStatus": RequestStatus},
    }

    def install_hybrid(real_files, extra_overrides=None, version="0.0.0"):
        real_files = dict(real_files)
        real_files["vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils"] = ssm_file
        overrides = {k: dict(v) for k, v in (extra_overrides or {}).items()}
        for k, v in more.items():
            overrides.setdefault(k, {}).update(v)
        return install(real_files, overrides, version)

    stubs.install = install_hybrid


_extend_harness()

import v033 as V  # noqa: E402
from fake_nixl import expand_descs  # noqa: E402
from fake_tensor import FakeStorage, FakeTensor  # noqa: E402

P_BASE = 0x1_0000_0000
D_BASE = 0x100_0000_0000
RANK_STRIDE = 1 << 32
DSZ = {"bfloat16": 2, "float16": 2, "float32": 4}
MBE = MambaAttentionBackendEnum


def cdiv(a, b):
    return -(a // -b)


# ----------------------------------------------------------------------------- models
# Each model: list of layers in module-registration order, each (name, kind) with kind in
# "full", "swa", "state"; attention shape; state params.

def nemotron_h(n_layers_pattern=("M", "-", "M", "*", "-", "M", "-", "M", "*"), pattern=None):
    if pattern is not None:
        n_layers_pattern = tuple(pattern)
    layers = []
    for i, t in enumerate(n_layers_pattern):
        if t == "M":
            layers.append((f"model.layers.{i}.mixer", "state"))
        elif t == "*":
            layers.append((f"model.layers.{i}.mixer.attn", "full"))
    return dict(
        key="mamba2_nemotronh", layers=layers, kv_heads=8, head_dim=128, dtype="bfloat16",
        state=dict(kind="mamba2", intermediate_size=8192, n_groups=8, num_heads=128, head_dim=64,
                   state_size=128, conv_kernel=4, dtypes=("bfloat16", "float32")),
        model_json={"num_layers_real": 52, "kv_layers_real": "24 mamba + 4 attention",
                    "attn_kv_heads": 8, "attn_head_dim": 128,
                    "mamba": {"intermediate_size": 8192, "n_groups": 8, "num_heads": 128,
                              "head_dim": 64, "state_size": 128, "conv_kernel": 4},
                    "mamba_dtypes": ["bfloat16", "float32"]},
        note="Nemotron-H-8B geometry (Mamba2: 128 heads x 64, d_state 128, n_groups 8, conv 4; "
             "attention 8 KV heads x 128; ssm state fp32), 4 mamba + 2 attention layers -> 2 mamba "
             "groups + 1 attention group, 2 aliased regions.",
        prompt=2500,
    )


def qwen3_next(gdn_align=1, pattern=None):
    suffix = '' if gdn_align == 1 else '_flashinfer'
    layers = []
    kinds = pattern or "GGGAGGGA"  # G: GDN (linear_attn), A: full attention
    for i, k in enumerate(kinds):
        if k == "A":
            layers.append((f"model.layers.{i}.self_attn.attn", "full"))
        else:
            layers.append((f"model.layers.{i}.linear_attn", "state"))
    return dict(
        key="gdn_qwen3next" + suffix, layers=layers, kv_heads=2, head_dim=256, dtype="bfloat16",
        state=dict(kind="gdn", num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                   conv_kernel=4, dtypes=("bfloat16", "bfloat16"), align=gdn_align),
        model_json={"num_layers_real": 48, "kv_layers_real": "36 GDN + 12 full", "attn_kv_heads": 2,
                    "attn_head_dim": 256,
                    "gdn": {"num_k_heads": 16, "num_v_heads": 32, "head_k_dim": 128,
                            "head_v_dim": 128, "conv_kernel": 4},
                    "dtypes": ["bfloat16", "bfloat16"]},
        note="Qwen3-Next geometry (GDN: 16 K heads, 32 V heads, head dims 128, conv 4; attention 2 KV "
             "heads x 256), 6 GDN + 2 full -> 3 GDN groups + 1 full group. Block alignment as with the "
             f"triton GDN prefill backend: lcm(16, {gdn_align}).",
        prompt=1200,
    )


def jamba(n_layers=8):
    layers = []
    for i in range(n_layers):
        if i % 8 == 4:
            layers.append((f"model.layers.{i}.attn", "full"))
        else:
            layers.append((f"model.layers.{i}.mixer", "state"))
    return dict(
        key="mamba1_jamba", layers=layers, kv_heads=8, head_dim=128, dtype="bfloat16",
        state=dict(kind="mamba1", intermediate_size=8192, state_size=16, conv_kernel=4,
                   dtypes=("bfloat16", "bfloat16")),
        model_json={"num_layers_real": 32, "kv_layers_real": "28 mamba + 4 attention",
                    "attn_kv_heads": 8, "attn_head_dim": 128,
                    "mamba": {"intermediate_size": 8192, "state_size": 16, "conv_kernel": 4,
                              "dt_rank": 256},
                    "mamba_dtypes": ["bfloat16", "bfloat16"]},
        note="Jamba-v0.1 geometry (Mamba1: d_inner 8192, d_state 16, d_conv 4, dt_rank 256; attention "
             "8 KV heads x 128, every 8th layer offset 4), 8 layers -> 7 mamba groups of 1 + 1 "
             "attention group, 1 aliased region.",
        prompt=1000,
    )


def falcon_h1(n_layers=4):
    # FalconH1ParallelHybrid: attention prefix model.layers.{i}, SSM prefix model.{L+i}
    layers = []
    for i in range(n_layers):
        layers.append((f"model.layers.{i}.attn", "full"))
        layers.append((f"model.{n_layers + i}.mixer", "state"))
    return dict(
        key="mamba2_falconh1", layers=layers, kv_heads=2, head_dim=128, dtype="bfloat16",
        state=dict(kind="mamba2", intermediate_size=3072, n_groups=1, num_heads=24, head_dim=128,
                   state_size=256, conv_kernel=4, dtypes=("bfloat16", "bfloat16")),
        model_json={"num_layers_real": 44, "kv_layers_real": "attention + mamba2 in every layer",
                    "attn_kv_heads": 2, "attn_head_dim": 128,
                    "mamba": {"intermediate_size": 3072, "n_groups": 1, "num_heads": 24,
                              "head_dim": 128, "state_size": 256, "conv_kernel": 4},
                    "mamba_dtypes": ["bfloat16", "bfloat16"]},
        note="Falcon-H1-7B geometry (attention 2 KV heads x 128 and Mamba2 d_ssm 3072, 24 heads x 128, "
             "d_state 256, n_groups 1 in the same decoder layer; vLLM names the SSM branch "
             "model.{L+i}.mixer), 4 layers -> 1 attention group + 1 mamba group, 4 aliased regions.",
        prompt=3000,
    )


def granite_h_tiny():
    layers = []
    for i in range(5):
        if i == 2:
            layers.append((f"model.layers.{i}.self_attn.attn", "full"))
        else:
            layers.append((f"model.layers.{i}.mixer", "state"))
    return dict(
        key="mamba2_granite4htiny", layers=layers, kv_heads=4, head_dim=128, dtype="bfloat16",
        state=dict(kind="mamba2", intermediate_size=3072, n_groups=1, num_heads=48, head_dim=64,
                   state_size=128, conv_kernel=4, dtypes=("bfloat16", "bfloat16")),
        model_json={"num_layers_real": 40, "kv_layers_real": "36 mamba + 4 attention",
                    "attn_kv_heads": 4, "attn_head_dim": 128,
                    "mamba": {"intermediate_size": 3072, "n_groups": 1, "num_heads": 48,
                              "head_dim": 64, "state_size": 128, "conv_kernel": 4},
                    "mamba_dtypes": ["bfloat16", "bfloat16"]},
        note="granite-4.0-h-tiny geometry (Mamba2 48 heads x 64, d_state 128, n_groups 1, conv 4; "
             "attention 4 KV heads x 128), 4 mamba + 1 attention layers -> 4 mamba groups of 1 + 1 "
             "attention group, 1 aliased region.",
        prompt=1500,
    )


def gpt_oss(pattern=None):
    layers = []
    for i, k in enumerate(pattern or "SFSF"):  # S: sliding window, F: full
        layers.append((f"model.layers.{i}.attn.attn", "swa" if k == "S" else "full"))
    return dict(
        key="swa_gptoss", layers=layers, kv_heads=8, head_dim=64, dtype="bfloat16", window=128,
        state=None,
        model_json={"num_layers_real": 36, "num_layers_here": 4, "kv_heads": 8, "head_dim": 64,
                    "sliding_window": 128, "dtype": "bfloat16"},
        note="gpt-oss geometry (8 KV heads, head_dim 64, bf16, SWA window 128 on even layers, full on "
             "odd), 4 layers -> 2 groups (group0=SWA [0,2], group1=full [1,3]); 2 aliased regions.",
        prompt=200,
    )


def gemma3(n_layers=6, pattern=None):
    layers = []
    kinds = pattern or "".join("F" if i % 6 == 5 else "S" for i in range(n_layers))
    n_layers = len(kinds)
    for i, k in enumerate(kinds):
        layers.append((f"model.layers.{i}.self_attn.attn", "full" if k == "F" else "swa"))
    return dict(
        key="swa_gemma3", layers=layers, kv_heads=4, head_dim=256, dtype="bfloat16", window=1024,
        state=None,
        model_json={"num_layers_real": 34, "num_layers_here": n_layers, "kv_heads": 4, "head_dim": 256,
                    "sliding_window": 1024, "dtype": "bfloat16"},
        note="Gemma-3-4b geometry (4 KV heads x 256, bf16, SWA window 1024, 5 local : 1 global), "
             f"{n_layers} layers -> SWA groups of 1 + 1 full group, 1 aliased region.",
        prompt=3000,
    )


MODELS = {"gemma3": gemma3, "nemotronh": nemotron_h, "qwen3next": qwen3_next, "jamba": jamba,
          "falconh1": falcon_h1, "granite": granite_h_tiny, "gptoss": gpt_oss}


# ----------------------------------------------------------------------------- geometry
def state_shapes(st, tp):
    """MambaStateShapeCalculator (DS conv layout), re-expressed."""
    k = st["kind"]
    if k == "mamba1":
        assert st["intermediate_size"] % tp == 0
        d = st["intermediate_size"] // tp
        return ((d, st["conv_kernel"] - 1), (d, st["state_size"])), MBE.MAMBA1
    if k == "mamba2":
        ng = st["n_groups"]
        if ng % tp != 0:
            ng = ng + (tp - ng)  # extra_groups_for_head_shards
        conv_dim = st["intermediate_size"] + 2 * ng * st["state_size"]
        assert conv_dim % tp == 0 and st["num_heads"] % tp == 0
        return ((conv_dim // tp, st["conv_kernel"] - 1),
                (st["num_heads"] // tp, st["head_dim"], st["state_size"])), MBE.MAMBA2
    if k == "gdn":
        conv_dim = st["head_k_dim"] * st["num_k_heads"] * 2 + st["head_v_dim"] * st["num_v_heads"]
        assert conv_dim % tp == 0 and st["num_v_heads"] % tp == 0
        return ((conv_dim // tp, st["conv_kernel"] - 1),
                (st["num_v_heads"] // tp, st["head_v_dim"], st["head_k_dim"])), MBE.GDN_ATTN
    raise ValueError(k)


def engine_geometry(m, tp, block_override=None):
    dt = m["dtype"]
    h = max(1, m["kv_heads"] // tp)
    attn_1tok = h * m["head_dim"] * 2 * DSZ[dt]
    g = dict(tp=tp, local_kv_heads=h, attn_page_1tok=attn_1tok)
    st = m.get("state")
    if st is None:
        b = block_override or 16
        g.update(block=b, page=b * attn_1tok, state=None)
        return g
    shapes, mtype = state_shapes(st, tp)
    real = sum(math.prod(s) * DSZ[d] for s, d in zip(shapes, st["dtypes"]))
    align = math.lcm(16, st.get("align", 1))  # kernel block 16 (FLASH_ATTN), mamba align mode
    block = align * cdiv(real, align * attn_1tok)
    block = 16 * cdiv(block, 16)
    block = max(block, 16)
    page = block * attn_1tok
    padded = page if page != real else None
    g.update(block=block, page=page, state=dict(shapes=shapes, dtypes=st["dtypes"], mtype=mtype,
                                                real=real, padded=padded))
    return g


def make_specs(m, geo):
    h, hd, dt, B = geo["local_kv_heads"], m["head_dim"], m["dtype"], geo["block"]
    specs = {}
    made = {}
    for name, kind in m["layers"]:
        if kind in made:
            specs[name] = made[kind]
            continue
        if kind == "full":
            specs[name] = stubs.FullAttentionSpec(block_size=B, num_kv_heads=h, head_size=hd, dtype=dt,
                                                  page_size_bytes=geo["page"])
        elif kind == "swa":
            specs[name] = stubs.SlidingWindowSpec(block_size=B, num_kv_heads=h, head_size=hd, dtype=dt,
                                                  page_size_bytes=geo["page"],
                                                  sliding_window=m["window"])
        else:
            s = geo["state"]
            specs[name] = HybridMambaSpec(block_size=B, page_size_bytes=s["padded"] or s["real"],
                                          shapes=s["shapes"], dtypes=tuple(s["dtypes"]),
                                          page_size_padded=s["padded"], mamba_type=s["mtype"])
        made[kind] = specs[name]
    return specs


def form_groups(specs):
    """_get_kv_cache_groups_uniform_page_size, re-expressed (specs here never merge); counts that
    do not divide leave the last group of a kind short (vLLM's padding layers hold no names)."""
    buckets = {}
    for name, spec in specs.items():
        buckets.setdefault(spec, []).append(name)
    lists = list(buckets.values())
    mn = min(len(l) for l in lists)
    mx = max(len(l) for l in lists)
    gs = mx if mx < mn * 1.5 else mn
    groups = []
    for l in lists:
        n = cdiv(len(l), gs)  # the last group of a kind short of gs layers: vLLM pads it
        for i in range(n):
            groups.append(l[i::n])
    return groups, gs


SPEC_NAME = {stubs.FullAttentionSpec: "FullAttentionSpec", stubs.SlidingWindowSpec: "SlidingWindowSpec",
             HybridMambaSpec: "MambaSpec"}


def build_engine(m, tp, num_blocks, role, engine_id, kv_buffer_device="cuda", block_override=None):
    geo = engine_geometry(m, tp, block_override)
    specs = make_specs(m, geo)
    groups, gs = form_groups(specs)
    gobjs = [NS(kv_cache_spec=specs[names[0]], layer_names=list(names), host_resident=False)
             for names in groups]
    kvc = NS(
        num_blocks=num_blocks, transfer_groups=gobjs, kv_cache_groups=gobjs,
        transfer_group_index_by_layer={n: gi for gi, names in enumerate(groups) for n in names},
        transfer_group_ids=tuple(range(len(groups))),
        has_mamba_layers=any(isinstance(s, HybridMambaSpec) for s in specs.values()),
        hisparse_host_num_blocks=None, hisparse_shared_host_pool=False,
        select_transfer_block_ids=lambda b: b,
    )
    layout_enum = V.KVCacheLayout["LBHNC"]
    n_layers = len({n.split(".mixer")[0] for n, _ in m["layers"]})
    vcfg = NS(
        kv_transfer_config=V.ExtraCfg({}, role, False, engine_id),
        cache_config=NS(block_size=geo["block"], cache_dtype="auto",
                        get_resolved_kv_cache_layout=lambda: layout_enum, enable_prefix_caching=True),
        scheduler_config=NS(disable_hybrid_kv_cache_manager=False),
        parallel_config=NS(tensor_parallel_size=tp, prefill_context_parallel_size=1,
                           decode_context_parallel_size=1, pipeline_parallel_size=1,
                           data_parallel_index=0),
        model_config=NS(model="hybrid/" + m["key"], dtype=f"torch.{m['dtype']}", use_mla=False,
                        enable_sleep_mode=False,
                        get_total_num_kv_heads=lambda: m["kv_heads"],
                        get_head_size=lambda: m["head_dim"],
                        get_total_num_hidden_layers=lambda: len(m["layers"])),
        speculative_config=None, num_prefill_lookahead_tokens=0,
    )
    vcfg.kv_transfer_config.kv_buffer_device = kv_buffer_device
    return dict(m=m, geo=geo, specs=specs, groups=groups, group_size=gs, kvc=kvc, vcfg=vcfg, kvbd=kv_buffer_device,
                num_blocks=num_blocks, tp=tp, engine_id=engine_id)


def allocate_views(e, base):
    """Layer-outer LBHNC: every group aliases from byte 0; layer k of a group at
    k * num_blocks * page. Attention view [B,H,N,C]; Mamba view [B,1,1,real_page] bytes."""
    geo, nb = e["geo"], e["num_blocks"]
    page = geo["page"]
    size = e["group_size"] * page * nb
    storage = FakeStorage(base, size)
    views = {}
    m = e["m"]
    isz = DSZ[m["dtype"]]
    for names in e["groups"]:
        for k, name in enumerate(names):
            off = k * nb * page
            spec = e["specs"][name]
            if isinstance(spec, HybridMambaSpec):
                real = geo["state"]["real"]
                views[name] = FakeTensor(storage, off, (nb, 1, 1, real), (page, real, real, 1), 1)
                views[name].dtype = "uint8"
            else:
                H, N = geo["local_kv_heads"], geo["block"]
                C = 2 * m["head_dim"] * isz
                views[name] = FakeTensor(storage, off, (nb, H, N, C // isz),
                                         (page // isz, N * C // isz, C // isz, 1), isz)
                views[name].dtype = m["dtype"]
    return views, size


HOST_OFF = 0x8000_0000_0000
_HOST = {"next": None, "slot": None}


def _torch_empty(shape, dtype=None, device=None, **k):
    """Host buffers (initialize_host_xfer_buffer): one separate allocation per layer, placed at
    host base + i * (num_blocks * page) in kv_caches order (the public oracle's convention)."""
    isz = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1, "int8": 1}[dtype]
    addr = _HOST["next"]
    _HOST["next"] += _HOST["slot"]
    st = FakeStorage(addr, math.prod(shape) * isz)
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    t = FakeTensor(st, 0, shape, strides, isz, device="cpu")
    t.dtype = dtype
    return t


V.bw.torch.empty = _torch_empty


def make_worker(e, rank, base):
    _HOST["next"] = base + HOST_OFF
    _HOST["slot"] = e["num_blocks"] * e["geo"]["page"]
    V._RANK["tp_rank"] = rank
    V._RANK["tp_size"] = e["tp"]
    V._patch_backends("FLASH_ATTN")
    w = V.pw.NixlPullConnectorWorker(e["vcfg"], e["engine_id"], e["kvc"])
    views, size = allocate_views(e, base)
    w.register_kv_caches(views)
    w._oracle_base = base
    return w


def make_scheduler(e):
    return V.ps.NixlPullConnectorScheduler(e["vcfg"], e["engine_id"], e["kvc"])


# ----------------------------------------------------------------------------- block lists
def raw_lists(e, n_tokens, first_ids):
    """Block lists as the allocator leaves them (input to vLLM's clipping): full attention
    consecutive ids; SWA null (0) before the window; Mamba align mode: nulls then one state slot."""
    B = e["geo"]["block"]
    nblk = cdiv(n_tokens, B)
    out = []
    nxt = first_ids
    for names in e["groups"]:
        spec = e["specs"][names[0]]
        if isinstance(spec, HybridMambaSpec):
            out.append([0] * (nblk - 1) + [nxt[1]])
            nxt = (nxt[0], nxt[1] + 1, nxt[2])
        elif isinstance(spec, stubs.SlidingWindowSpec):
            nnull = max(0, n_tokens - spec.sliding_window + 1) // B
            ids = list(range(nxt[2], nxt[2] + nblk - nnull))
            out.append([0] * nnull + ids)
            nxt = (nxt[0], nxt[1], nxt[2] + len(ids))
        else:
            out.append(list(range(nxt[0], nxt[0] + nblk)))
            nxt = (nxt[0] + nblk, nxt[1], nxt[2])
    return out


# ----------------------------------------------------------------------------- recording
def rows_of(arr, base, labels):
    out = []
    for i, (addr, ln, dev, stride, count) in enumerate(np.asarray(arr).tolist()):
        out.append(dict(label=labels[i], addr_off=int(addr) - base, len=int(ln), stride=int(stride),
                        count=int(count)))
    return out


def row_labels(w, n_fa_rows, ssm_regions):
    parts = {MBE.MAMBA1: ["x"], MBE.MAMBA2: ["x", "B", "C"], MBE.GDN_ATTN: ["Q", "K", "V"]}
    labels = [f"attn_page:region{i}" for i in range(n_fa_rows)]
    if w._has_mamba:
        mspec = next(s for s in w._layer_specs.values() if isinstance(s, HybridMambaSpec))
        for r in ssm_regions:
            labels += [f"mamba_conv_{p}:region{r}" for p in parts[mspec.mamba_type]]
            labels.append(f"mamba_ssm:region{r}")
    return labels


def regions_of(w, base):
    out = []
    for i, b in enumerate(w.kv_caches_base_addr[w.engine_id][w.tp_rank]):
        out.append(dict(region=i, name=w.region_names[i], group_id=w.region_group_ids[i],
                        base_off=b - base, block_len=w.block_len_per_layer[i],
                        block_stride=w.block_stride_per_layer[i],
                        num_blocks=w.region_num_blocks[i]))
    return out


def registered_of(w, base):
    out = []
    for descs in w.nixl_wrapper.registered:
        for (start, ln, dev, _n) in descs["regions"]:
            out.append(dict(off=start - base, len=ln, mem_type=descs["mem_type"]))
    return out


def agent_meta(w, base):
    _, meta = V.decode_agent_meta(V.encode_payload(w))
    return {
        "ssm_sizes(conv_bytes,ssm_bytes)": list(meta.ssm_sizes),
        "block_size": meta.block_size, "num_blocks": meta.num_blocks,
        "block_lens": list(meta.block_lens), "block_strides": list(meta.block_strides),
        "kv_cache_layout": meta.kv_cache_layout,
        "physical_blocks_per_logical_kv_block": meta.physical_blocks_per_logical_kv_block,
        "region_num_blocks": list(meta.region_num_blocks),
        "region_group_ids": list(meta.region_group_ids),
        "region_names": list(meta.region_names),
        "region_mem_types": list(meta.region_mem_types),
        "kv_caches_base_addr_off": [a - base for a in meta.kv_caches_base_addr],
        "attn_backend_name": meta.attn_backend_name,
    }


def engine_json(e):
    g = e["geo"]
    out = dict(tp=e["tp"], block_size_tokens=g["block"], num_blocks=e["num_blocks"],
               local_kv_heads=g["local_kv_heads"], page_bytes=g["page"], kv_buffer_device=e["kvbd"],
               groups=[dict(group=i, spec=SPEC_NAME[type(e["specs"][n[0]])], layers=list(n))
                       for i, n in enumerate(e["groups"])])
    if g["state"]:
        s = g["state"]
        out.update(mamba_state_shapes_local=[list(x) for x in s["shapes"]],
                   mamba_state_dtypes=list(s["dtypes"]), mamba_real_page_bytes=s["real"],
                   mamba_page_size_padded=s["padded"] or s["real"])
    return out


def where(exc):
    tb = traceback.extract_tb(exc.__traceback__)
    fr = tb[-1]
    return f"{os.path.basename(fr.filename)}:{fr.lineno} ({fr.name})"


def run_case(model_key, p_tp, d_tp, name=None, p_blocks=None, d_blocks=None, prompt=None, model_kw=None,
             p_raw_in=None, d_raw_in=None, kvbd="cuda"):
    model_kw = dict(model_kw or {})
    p_bs = model_kw.pop("p_bs", None)
    d_bs = model_kw.pop("d_bs", None)
    m = MODELS[model_key](**model_kw)
    prompt = prompt or m["prompt"]
    name = name or f"{m['key']}_P{p_tp}_D{d_tp}"
    # pools big enough for the request
    pe0 = build_engine(m, p_tp, 1, "kv_producer", "P")
    blk = pe0["geo"]["block"]
    n_attn = sum(1 for n in pe0["groups"] if not isinstance(pe0["specs"][n[0]], HybridMambaSpec))
    # every attention group's blocks, one slot per state group (ids are consecutive across groups)
    need = cdiv(prompt, min(blk, engine_geometry(m, d_tp)["block"])) * max(1, n_attn) + len(pe0["groups"]) + 4
    if m.get("state") is None:
        need = max(40, (cdiv(prompt, 16) + 2) * (len(pe0["groups"]) + 1) + 40)
    p_blocks = p_blocks or max(8, need + 4)
    d_blocks = d_blocks or max(10, need + 8)
    pe = build_engine(m, p_tp, p_blocks, "kv_producer", "P", kvbd, p_bs)
    de = build_engine(m, d_tp, d_blocks, "kv_consumer", "D", kvbd, d_bs)

    # ---- scheduler side (vLLM's own clipping) ----
    psch = make_scheduler(pe)
    dsch = make_scheduler(de)
    backoff = psch._prefill_backoff()
    p_computed = prompt - backoff if backoff and prompt > backoff else prompt
    ngroups = len(pe["groups"])
    n_full_p = sum(1 for n in pe["groups"] if isinstance(pe["specs"][n[0]], stubs.FullAttentionSpec))
    p_raw = raw_lists(pe, p_computed, (1, p_blocks - 3 if pe["geo"]["state"] else 0, 20))
    # mamba slots near the top of the pool, attention from 1
    if pe["geo"]["state"]:
        p_raw = raw_lists(pe, p_computed, (1, p_blocks - ngroups, 20))
    if p_raw_in is not None:
        p_raw = [list(g) for g in p_raw_in]
    preq = NS(request_id="req-P", kv_transfer_params={"do_remote_decode": True},
              status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=p_computed,
              num_prompt_tokens=prompt - backoff)
    delay, params = psch.request_finished(preq, [list(g) for g in p_raw])
    params = dict(params)
    params["remote_block_ids"] = [list(g) for g in params["remote_block_ids"]]

    dreq = NS(request_id="req-D", prompt_token_ids=list(range(prompt)), num_prompt_tokens=prompt,
              kv_transfer_params=dict(params))
    n_ext, _async = dsch.get_num_new_matched_tokens(dreq, 0)
    if de["geo"]["state"]:
        d_raw = raw_lists(de, n_ext + backoff, (2, d_blocks - ngroups, 30))
    else:
        d_raw = raw_lists(de, n_ext, (3, 0, 30))
    if d_raw_in is not None:
        d_raw = [list(g) for g in d_raw_in]
    blocks = NS(get_unhashed_block_ids_all_groups=lambda: [list(g) for g in d_raw],
                blocks=[[NS(block_hash=None, is_null=(b == 0)) for b in g] for g in d_raw])
    dsch.update_state_after_alloc(dreq, blocks, n_ext)
    _, d_local, d_computed, _aw = dsch._reqs_need_recv["req-D"]
    d_local = [list(g) for g in d_local]

    case = dict(name=name, note=m["note"], vllm_version="0.33.0", model=m["model_json"],
                p=engine_json(pe), d=engine_json(de))
    case["scheduler"] = {
        "prompt_tokens": prompt, "p_prefill_backoff_tokens": backoff,
        "p_num_computed_tokens_at_finish": p_computed,
        "p_blocks_per_sw": list(psch.blocks_per_sw),
        "p_raw_block_ids": p_raw, "p_request_finished_delay_free": delay,
        "remote_block_ids_sent": params["remote_block_ids"],
        "remote_num_tokens": params["remote_num_tokens"],
        "d_num_external_tokens": n_ext,
        "d_raw_unhashed_block_ids": d_raw,
        "d_local_block_ids_after_clip": d_local,
    }

    # ---- workers ----
    pws = [make_worker(pe, r, P_BASE + r * RANK_STRIDE) for r in range(p_tp)]
    hb = HOST_OFF if kvbd == "cpu" else 0
    case["p_ranks"] = []
    for r, w in enumerate(pws):
        pr = dict(p_rank=r, regions=regions_of(w, w._oracle_base),
                  registered_memory=registered_of(w, w._oracle_base),
                  agent_metadata=agent_meta(w, w._oracle_base + hb))
        if kvbd == "cpu":
            rec = []
            w.set_host_xfer_buffer_ops(lambda src, dst, si, di, direction, rec=rec: rec.append(
                dict(direction=direction, layers_in_copy_order=list(src), block_ids=list(si))))
            sm = V.md.NixlConnectorMetadata()
            sm.add_new_req_to_save(request_id="req-P",
                                   local_block_ids=psch.get_exchange_clipped_blocks(
                                       [list(g) for g in p_raw], clip_ssm=False),
                                   kv_transfer_params={"do_remote_decode": True})
            w.save_kv_to_host(sm)
            pr["d2h_copy_plan(save_kv_to_host)"] = rec
        case["p_ranks"].append(pr)
    case["d_ranks"] = []
    for r in range(d_tp):
        w = make_worker(de, r, D_BASE + r * RANK_STRIDE)
        base = w._oracle_base + hb
        dr = dict(d_rank=r, regions=regions_of(w, w._oracle_base),
                  registered_memory=registered_of(w, w._oracle_base))
        V._RANK["tp_rank"] = r
        V._RANK["tp_size"] = d_tp
        try:
            ranks, agents = V.direct_handshake(w, pws, p_tp, "P")
        except Exception as exc:  # noqa: BLE001
            dr["handshake_rejected"] = dict(error_type=type(exc).__name__, error=str(exc),
                                            raised_at=where(exc))
            case["d_ranks"].append(dr)
            V.shutdown(w)
            break
        dr["handshake_ranks"] = list(ranks)
        plan = w.tp_mappings["P"]
        dr["tp_mapping"] = {
            "source_ranks_per_group": [list(x) for x in plan.source_ranks_per_group],
            "all_source_ranks": list(plan.all_source_ranks),
            "rank_to_attention_slot": {str(k): v for k, v in plan.rank_to_attention_slot.items()},
            "rank_offset_factor": plan.rank_offset_factor,
            "local_consumers(notif count P waits for)": plan.local_consumers,
        }
        info = w.transfer_topo.get_engine_info("P")
        dr["tp_ratio"] = w.transfer_topo.tp_ratio(p_tp)
        dr["block_size_ratio"] = w.transfer_topo.block_size_ratio(info.remote_block_size)
        ssm_regions = list(w._ssm_region_indices or range(w.num_regions)) if w._has_mamba else []
        lab = row_labels(w, w.num_regions, ssm_regions)
        dr["local_dlists(strided rows)"] = {
            f"local_block_size_{w.block_size}": rows_of(w.src_blocks_data, base, lab)}
        local_names = {h: f"local_block_size_{bs}" for bs, h in w.src_xfer_handles_by_block_size.items()}
        for key, hs in w.src_xfer_handles_by_tp_ratio.items():
            for i, h in enumerate(hs):
                local_names[h] = f"local_split_tp{key[0]}_bs{key[1]}_src{i}"
        remote_names = {}
        dr["remote_dlists(strided rows)"] = {}
        for pr, h in sorted(w.dst_xfer_side_handles["P"].items()):
            remote_names[h] = f"remote_p_rank_{pr}"
            raw = w.nixl_wrapper.dlists[h]["raw"]
            pbase = P_BASE + pr * RANK_STRIDE + hb
            n_rem_fa = len(pws[pr].region_names)
            rl = row_labels(w, n_rem_fa, ssm_regions)
            dr["remote_dlists(strided rows)"][f"remote_p_rank_{pr}"] = rows_of(raw, pbase, rl)
        # ---- the READ(s) for the request ----
        before = set(w.nixl_wrapper.xfers)
        nb = len(w.nixl_wrapper.notifs_sent)
        meta = V.md.NixlConnectorMetadata()
        meta.add_new_req_to_recv("req-D", [list(g) for g in d_local], dict(params),
                                 local_num_computed_blocks=tuple(d_computed), awaiting_kvs=True)
        w.start_load_kv(meta)
        reads = []
        for h in sorted(set(w.nixl_wrapper.xfers) - before):
            x = w.nixl_wrapper.xfers[h]
            lraw = w.nixl_wrapper.dlists[x["local_handle"]]["raw"]
            rraw = w.nixl_wrapper.dlists[x["remote_handle"]]["raw"]
            # per-desc labels from the row each desc id falls in
            lrows = np.asarray(lraw)
            desc_label = []
            for ri, row in enumerate(lrows.tolist()):
                desc_label += [lab[ri]] * int(row[4])
            lexp = expand_descs(lraw)
            rexp = expand_descs(rraw)
            pr = int(remote_names[x["remote_handle"]].rsplit("_", 1)[1])
            pbase = P_BASE + pr * RANK_STRIDE + hb
            pairs = []
            for li, ri in zip(x["local_ids"], x["remote_ids"]):
                la, ll, _ = lexp[li]
                ra, rl, _ = rexp[ri]
                assert ll == rl, (ll, rl)
                pairs.append([desc_label[li], la - base, ra - pbase, ll])
            msg = x["notif_msg"]
            reads.append(dict(op=str(x["op"]), local_dlist=local_names.get(x["local_handle"], "?"),
                              remote_dlist=remote_names[x["remote_handle"]],
                              notif_msg=msg.decode() if isinstance(msg, bytes) else msg,
                              num_descs=len(pairs), **{"pairs[label,local_off,remote_off,len]": pairs}))
        dr["reads"] = reads
        if kvbd == "cpu":
            rec = []
            w.set_host_xfer_buffer_ops(lambda src, dst, si, di, direction, rec=rec: rec.append(
                dict(direction=direction, layers_in_copy_order=list(src), block_ids=list(si))))
            w.sync_recved_kv_to_device("req-D", meta.reqs_to_recv["req-D"])
            dr["h2d_copy_plan(sync_recved_kv_to_device)"] = rec
        dr["notifs_only"] = [[a, (n.decode() if isinstance(n, bytes) else n)]
                             for a, n in w.nixl_wrapper.notifs_sent[nb:]]
        case["d_ranks"].append(dr)
        V.shutdown(w)
    for w in pws:
        V.shutdown(w)
    return case


PUBLIC_MODEL = {"swa_gptoss_hostbuf": "gptoss", "mamba2_nemotronh_hostbuf": "nemotronh", "swa_gptoss": "gptoss", "mamba2_nemotronh": "nemotronh", "gdn_qwen3next": "qwen3next"}


def rerun_public(pc):
    key = next(k for k in PUBLIC_MODEL if pc["name"].startswith(k))
    s = pc["scheduler"]
    return run_case(PUBLIC_MODEL[key], pc["p"]["tp"], pc["d"]["tp"], name=pc["name"],
                    p_blocks=pc["p"]["num_blocks"], d_blocks=pc["d"]["num_blocks"],
                    prompt=s["prompt_tokens"], p_raw_in=s["p_raw_block_ids"],
                    d_raw_in=s["d_raw_unhashed_block_ids"], kvbd=pc["p"]["kv_buffer_device"])


USAGE = """case spec: MODEL:P_TP:D_TP[:NAME[:k=v,...]]
  MODEL  one of: %s
  NAME   case name (default <model key>_P<p>_D<d>)
  k=v    integers: prompt=TOKENS, hostbuf=1 (kv_buffer_device cpu: host buffers),
         n_layers=N (jamba, falconh1, gemma3), pattern=STR (the layer kinds in order: nemotronh
         M/*/-, qwen3next G/A, gptoss and gemma3 S/F), gdn_align=A (qwen3next: FlashInfer GDN uses 64),
         p_bs=/d_bs= (block size of a model without state layers, as --block-size),
         p_blocks=/d_blocks= (KV pool sizes; default: sized from the prompt)""" % ", ".join(MODELS)


def parse_spec(spec):
    parts = spec.split(":")
    mk, p, d = parts[0], int(parts[1]), int(parts[2])
    nm = parts[3] if len(parts) > 3 and parts[3] else None
    kw = {}
    if len(parts) > 4:
        for item in parts[4].split(","):
            k, v = item.split("=")
            kw[k] = v if k == "pattern" else int(v)
    run = dict(name=nm, prompt=kw.pop("prompt", None), kvbd="cpu" if kw.pop("hostbuf", 0) else "cuda",
               p_blocks=kw.pop("p_blocks", None), d_blocks=kw.pop("d_blocks", None))
    return mk, p, d, dict(run, model_kw=kw or None)


def main():
    import argparse
    a = argparse.ArgumentParser(epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--out", required=True, help="case file to write (hybrid_v033.json)")
    a.add_argument("-q", "--quiet", action="store_true", help="report failures only")
    a.add_argument("cases", nargs="+", help="MODEL:P_TP:D_TP[:NAME[:k=v,...]]")
    args = a.parse_args()
    cases = []
    failed = 0
    for spec in args.cases:
        try:
            mk, p, d, kw = parse_spec(spec)
            cases.append(run_case(mk, p, d, **kw))
            if not args.quiet:
                print("ok", spec, file=sys.stderr)
        except Exception:
            failed += 1
            print("FAILED", spec, file=sys.stderr)
            traceback.print_exc()
    doc = {"generator": "kvx scripts/hybrid-oracle/hybrid.py run over vLLM 0.33.0's own NixlConnector "
                        "(pull) code under recorders (schedulers, workers, derive_mamba_conv_split)",
           "vllm_version": "0.33.0",
           "offsets": "relative to each rank's KV base (P 0x1_0000_0000+r*2^32, D 0x100_0000_0000+r*2^32; "
                      "host buffers at +0x8000_0000_0000)",
           "cases": cases}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{len(cases)} cases -> {args.out}" + (f"; {failed} FAILED" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
