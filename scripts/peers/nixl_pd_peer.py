#!/usr/bin/env python3
"""kvx's own NIXL P/D peer: a prefill engine and a decode rank that speak vLLM 0.33's
NixlConnector wire (pull mode), written against NIXL's Python API.

On the wire it does what vLLM 0.33.0's NixlPullConnectorWorker and its scheduler's handshake
listener do, so kvx can be tested against it, and it can stand in for vLLM's own workers
(`../shared/vllm-peer/real_prefill.py`, `real_decode.py` beside the project): same flags, same
JSON lines.

  prefill --port 0 --request-id R [--tp 2 ...]
      One NIXL agent (UCX backend) and one host KV pool per TP rank, laid out as vLLM 0.33 lays
      out a CPU KV cache (one allocation; region per layer "model.layers.{i}.self_attn.attn";
      page = heads_per_rank * block_size * (K+V) * head_dim * 2 bytes; layout LBHNC), filled with
      byte = (region*131 + block*31 + offset_in_page) % 251. One ZMQ ROUTER side channel serves
      every rank's handshake payload. Prints {"ready", "side_channel", "engine_id",
      "compatibility_hash"}, then waits until every rank got the request's notifications
      ("R:n", freed after n of them) and prints {"finished_sending": [R], "seconds", "notifs"}.
  decode --port P --engine-id E --request-id R --blocks 1,2,3 [--tp 2 --tp-rank 1 ...]
      One decode rank: handshakes with the prefill ranks vLLM's TP mapping names, checks the
      compatibility hash first, loads their agents, prepares descriptor lists as vLLM does and
      posts one READ per remote rank with the notification "R:n"; local block i receives remote
      block blocks[i]. With --check-pattern every received byte is checked against the fill at
      the remote region, block and offset it came from.

Needs numpy, msgspec, pyzmq and nixl-cu12 (scripts/setup-peers.sh makes .venv-peers/ with
them). NIXL 1.5.1's bundled libnl can crash in exit handlers, so the process ends with
os._exit once its output is flushed.
"""
import argparse
import hashlib
import json
import os
import sys
import threading
import time
import uuid

import msgspec
import numpy as np
import zmq

try:
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError:
    from nixl_cu12._api import nixl_agent, nixl_agent_config

# --- vLLM 0.33.0 wire constants -------------------------------------------------------------
VLLM_VERSION = "0.33.0"
NIXL_CONNECTOR_VERSION = 15
GET_META_MSG = b"get_meta_msg"
LAYOUT = "LBHNC"
ATTN_BACKEND = "FLASH_ATTN"
DTYPE = "torch.bfloat16"
DTYPE_BYTES = 2
MEM_TYPE = "DRAM"
# vLLM's kv_connector_extra_config default num_threads, given to NIXL's UCX backend.
NIXL_NUM_THREADS = 4
# vLLM's handshake client: one REQ socket, 5 s per reply.
HANDSHAKE_TIMEOUT_MS = 5000
# NIXL reports no completion for a standalone notification (send_notif); a process that ends
# right after one loses it (measured here: always, connection set-up included). Half a second
# covers loopback with margin; vLLM's own decode never exits right after sending.
NOTIF_LINGER_S = 0.5


class AgentMetadata(msgspec.Struct):
    """vLLM 0.33's NixlAgentMetadata as msgspec puts it on the wire: a map keyed by field name,
    in this order, every field present (the defaults included)."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    ple_block_len: int | None = None
    region_members: list[list[str]] = []
    packed_member_layouts: dict[str, tuple[int, int]] = {}


class HandshakePayload(msgspec.Struct):
    """The reply's first frame. Decoded in two steps, as vLLM does: the hash is checked before
    agent_metadata_bytes is decoded, so an incompatible schema fails with the hash message."""

    compatibility_hash: str
    agent_metadata_bytes: bytes


def compatibility_hash(model, kv_heads, head_dim, layers):
    """vLLM 0.33's compute_nixl_compatibility_hash for a bf16 FLASH_ATTN model in pull mode."""
    factors = {
        "vllm_version": VLLM_VERSION,
        "nixl_connector_version": NIXL_CONNECTOR_VERSION,
        "model": model,
        "dtype": DTYPE,
        "num_kv_heads": kv_heads,
        "head_size": head_dim,
        "num_hidden_layers": layers,
        "attn_backend_name": ATTN_BACKEND,
        "cache_dtype": "auto",
        "is_hma_enabled": True,
        "speculative_config": None,
        "transfer_mode": "pull",
    }
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


class Pool:
    """One rank's KV cache: one allocation, LBHNC, a region per layer of num_blocks pages."""

    def __init__(self, args, tp, fill):
        self.layers = args.layers
        self.num_blocks = args.num_blocks
        self.heads = max(1, args.kv_heads // tp)  # vLLM's get_num_kv_heads
        # K and V packed per (head, token): C = 2 * head_dim * dtype bytes.
        self.page = self.heads * args.block_size * 2 * args.head_dim * DTYPE_BYTES
        self.region_bytes = self.num_blocks * self.page
        self.mem = np.zeros(self.layers * self.region_bytes, dtype=np.uint8)
        self.base = self.mem.ctypes.data
        if fill:
            offs = np.arange(self.page, dtype=np.int64)
            for r in range(self.layers):
                for b in range(self.num_blocks):
                    self.block(r, b)[:] = ((r * 131 + b * 31 + offs) % 251).astype(np.uint8)

    def region_base(self, r):
        return self.base + r * self.region_bytes

    def block(self, r, b):
        off = r * self.region_bytes + b * self.page
        return self.mem[off:off + self.page]


def expected_fill(region, block, remote_off, length):
    """The prefill fill for `length` bytes of (region, block) starting at remote_off."""
    offs = np.arange(remote_off, remote_off + length, dtype=np.int64)
    return ((region * 131 + block * 31 + offs) % 251).astype(np.uint8)


def region_names(layers):
    return [f"model.layers.{i}.self_attn.attn" for i in range(layers)]


def make_agent():
    # vLLM: nixl_agent_config(num_threads=..., capture_telemetry=True), UCX backend by default,
    # agent named by a fresh uuid4.
    cfg = nixl_agent_config(num_threads=NIXL_NUM_THREADS, capture_telemetry=True)
    return nixl_agent(str(uuid.uuid4()), cfg)


def register(agent, pool):
    # vLLM registers each backing allocation once: (start, length, device_id, "").
    descs = agent.get_reg_descs([(pool.base, len(pool.mem), 0, "")], MEM_TYPE)
    agent.register_memory(descs)
    return descs


def emit(obj):
    print(json.dumps(obj), flush=True)


def warn(msg):
    print(f"nixl_pd_peer: {msg}", file=sys.stderr, flush=True)


def leave(code):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# --- prefill --------------------------------------------------------------------------------


def serve_handshakes(sock, payloads, stop):
    """vLLM 0.33's handshake listener: ROUTER frames [identity, b"", msgpack([b"get_meta_msg",
    pp_rank, tp_rank])], reply [identity, b"", payload(pp, tp), msgpack(perf_counter())].

    vLLM's loop has no guard: an unknown (pp, tp) raises KeyError and a request that does not
    decode to three items raises, either of which ends its listener thread, so the asker gets
    no reply and every later handshake to that engine times out. Here such a request is left
    unanswered as well (the asker's REQ times out the same way), said on stderr, and the
    listener goes on serving the ranks it has. A first item other than get_meta_msg is
    answered anyway, as vLLM does (it only logs a warning)."""
    while not stop.is_set():
        if not sock.poll(100):
            continue
        frames = sock.recv_multipart()
        if len(frames) != 3 or frames[1] != b"":
            warn(f"side channel: ignoring a message of {len(frames)} frames (want identity, "
                 "empty, request: a REQ socket)")
            continue
        identity, _, msg = frames
        try:
            kind, pp_rank, tp_rank = msgspec.msgpack.decode(msg)
        except (msgspec.DecodeError, TypeError, ValueError) as e:
            warn(f"side channel: request {msg.hex()} is not [kind, pp_rank, tp_rank] ({e}); "
                 "not answered")
            continue
        if kind != GET_META_MSG:
            warn(f"side channel: unexpected message {kind!r}; answering as get_meta_msg")
        payload = payloads.get((pp_rank, tp_rank)) if isinstance(tp_rank, int) else None
        if payload is None:
            warn(f"side channel: no rank (pp {pp_rank}, tp {tp_rank}) here (ranks "
                 f"{sorted(payloads)}); not answered")
            continue
        ts = msgspec.msgpack.encode(time.perf_counter())
        sock.send_multipart([identity, b"", payload, ts])


def cmd_prefill(args):
    chash = compatibility_hash(args.model, args.kv_heads, args.head_dim, args.layers)
    ranks = []
    for rank in range(args.tp):
        pool = Pool(args, args.tp, fill=True)
        agent = make_agent()
        register(agent, pool)
        meta = AgentMetadata(
            engine_id=args.engine_id,
            agent_metadata=agent.get_agent_metadata(),
            kv_caches_base_addr=[pool.region_base(r) for r in range(args.layers)],
            device_id=0,
            num_blocks=args.num_blocks,
            block_lens=[pool.page] * args.layers,
            block_strides=[pool.page] * args.layers,
            kv_cache_layout=LAYOUT,
            block_size=args.block_size,
            ssm_sizes=(0, 0),
            attn_backend_name=ATTN_BACKEND,
            physical_blocks_per_logical_kv_block=1,
            region_num_blocks=[args.num_blocks] * args.layers,
            region_group_ids=[0] * args.layers,
            region_names=region_names(args.layers),
            region_mem_types=[MEM_TYPE] * args.layers,
        )
        payload = msgspec.msgpack.encode(HandshakePayload(
            compatibility_hash=chash, agent_metadata_bytes=msgspec.msgpack.encode(meta)))
        ranks.append((agent, pool, payload))

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # Port 0: ZMQ's wildcard port picks a free one at bind time, so there is no window in
    # which another process could take it.
    sock.bind(f"tcp://127.0.0.1:{args.port}" if args.port else "tcp://127.0.0.1:*")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    stop = threading.Event()
    listener = threading.Thread(
        target=serve_handshakes,
        args=(sock, {(0, r): p for r, (_, _, p) in enumerate(ranks)}, stop), daemon=True)
    listener.start()
    emit({"ready": True, "side_channel": endpoint, "engine_id": args.engine_id,
          "compatibility_hash": chash, "tp": args.tp})

    # vLLM's producer: every notification "<request id>:<n>" counts one reader; the request's
    # blocks are freed on a rank once n have come (n comes with each message). "HB:..." are
    # lease heartbeats.
    notifs = {r: [] for r in range(args.tp)}
    heartbeats = {r: 0 for r in range(args.tp)}
    counts = {r: 0 for r in range(args.tp)}
    done = set()
    t0 = time.time()
    while len(done) < args.tp and time.time() - t0 < args.timeout:
        for r, (agent, _, _) in enumerate(ranks):
            for sender, msgs in agent.get_new_notifs().items():
                for raw in msgs:
                    msg = raw.decode("utf-8", "replace")
                    if msg.startswith("HB:"):
                        heartbeats[r] += 1
                        continue
                    req, sep, n = msg.rpartition(":")
                    if not sep or not n.isdigit():
                        warn(f"rank {r}: notification {msg!r} from {sender} is not "
                             "<request id>:<n>")
                        continue
                    if req != args.request_id or r in done:
                        # vLLM logs "Potentially invalid KV blocks for unrecognized request".
                        warn(f"rank {r}: notification {msg!r} from {sender} for a request "
                             "not (or no longer) held")
                        continue
                    notifs[r].append(msg)
                    counts[r] += 1
                    if counts[r] == int(n):
                        done.add(r)
        time.sleep(0.001)
    stop.set()
    listener.join()
    ok = len(done) == args.tp
    out = {"finished_sending": [args.request_id] if ok else [],
           "seconds": round(time.time() - t0, 3),
           "notifs": {str(r): m for r, m in notifs.items()}}
    if any(heartbeats.values()):
        out["heartbeats"] = {str(r): n for r, n in heartbeats.items()}
    if not ok:
        out["ranks_pending"] = [r for r in range(args.tp) if r not in done]
    emit(out)
    leave(0 if ok else 1)


# --- decode ---------------------------------------------------------------------------------


class Mapping:
    """vLLM 0.33's TP mapping for one decode rank reading attention KV (no MLA, no DCP):
    TransferTopology.handshake_target_ranks, compute_tp_mapping, dcp_consumer_count."""

    def __init__(self, tp, tp_rank, remote_tp, kv_heads):
        if tp >= remote_tp:
            if tp % remote_tp:
                raise ValueError(f"Local tensor parallel size {tp} is not divisible by "
                                 f"remote tensor parallel size {remote_tp}.")
            self.tp_ratio = tp // remote_tp
            self.handshake_ranks = [tp_rank // self.tp_ratio]
            self.read_ranks = [tp_rank * remote_tp // tp]
        else:
            if remote_tp % tp:
                raise ValueError(f"Remote tensor parallel size {remote_tp} is not divisible "
                                 f"by local tensor parallel size {tp}.")
            k = remote_tp // tp
            self.tp_ratio = -k
            start = tp_rank * k
            self.handshake_ranks = [start + i for i in range(k)]
            # One read per distinct head: the first rank holding each (a no-op unless
            # remote_tp > kv_heads, which vLLM rejects below for attention models).
            heads = np.arange(start, start + k) * kv_heads // remote_tp
            _, first = np.unique(heads, return_index=True)
            self.read_ranks = (start + np.sort(first)).tolist()
        # Which heads of a remote block this rank takes (D > P), in units of its own block.
        if tp <= remote_tp:
            self.head_offset = 0
        elif tp > kv_heads:
            remote_rank = tp_rank * remote_tp // tp
            self.head_offset = tp_rank * kv_heads // tp - remote_rank * kv_heads // remote_tp
        else:
            self.head_offset = tp_rank % (tp // remote_tp)
        # Readers per remote rank, sent in every notification: the producer frees after this
        # many. D >= P: tp_ratio local ranks share a remote rank; P > D: one reader each.
        self.local_consumers = max(1, self.tp_ratio)
        self.replicated_remote = remote_tp > kv_heads


def fail(out, t0, msg):
    """vLLM reports a failed receive as finished (and its blocks as load errors)."""
    warn(msg)
    out.update(finished=True, failed=True, error=msg, seconds=round(time.time() - t0, 3))
    emit(out)
    leave(1)


def handshake(args, chash, mapping):
    """vLLM 0.33's client: one REQ socket, [b"get_meta_msg", pp, tp] per remote rank; the
    reply is [payload, msgpack(float)]; hash checked before the metadata is decoded."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, HANDSHAKE_TIMEOUT_MS)
    sock.connect(f"tcp://{args.host}:{args.port}")
    metas = {}
    try:
        for rank in mapping.handshake_ranks:
            sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, rank)))
            try:
                parts = sock.recv_multipart()
            except zmq.Again:
                raise RuntimeError(f"no handshake reply from {args.host}:{args.port} for "
                                   f"(pp 0, tp {rank}) within {HANDSHAKE_TIMEOUT_MS} ms")
            if len(parts) != 2:
                raise RuntimeError(f"handshake reply has {len(parts)} frames; vLLM 0.33 "
                                   "expects 2 (payload, clock)")
            msgspec.msgpack.decode(parts[1], type=float)
            try:
                payload = msgspec.msgpack.decode(parts[0], type=HandshakePayload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise RuntimeError(
                    "Failed to decode NixlHandshakePayload. This likely indicates an "
                    f"incompatibility between connector version. Error: {e}") from e
            if payload.compatibility_hash != chash:
                raise RuntimeError(
                    f"NIXL compatibility hash mismatch. Local: {chash}, Remote: "
                    f"{payload.compatibility_hash}. Prefill and decode instances have "
                    "incompatible configurations. This may be due to: different vLLM "
                    "versions, models, dtypes, KV cache layouts, attention backends, etc. "
                    "Both instances must use identical configurations.Disable this check "
                    "using --kv-transfer-config '{\"kv_connector_extra_config\": "
                    "{\"enforce_handshake_compat\": false}}'")
            try:
                meta = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=AgentMetadata)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise RuntimeError(f"Failed to decode NixlAgentMetadata. Error: {e}") from e
            if meta.engine_id != args.engine_id:
                raise RuntimeError(f"Remote NIXL agent engine ID mismatch. Expected "
                                   f"{args.engine_id},received {meta.engine_id}.")
            metas[rank] = meta
    finally:
        sock.close()
        ctx.term()
    return metas


def validate(args, mapping, pool, meta, first):
    """The checks of vLLM's _validate_remote_agent_handshake that apply to this layout."""
    if mapping.tp_ratio < 0 and mapping.replicated_remote:
        # vLLM: a bare assert (P TP > D TP with P TP > KV heads).
        raise RuntimeError(f"remote TP {args.remote_tp} > local TP {args.tp} with remote TP > "
                           f"{args.kv_heads} KV heads: vLLM 0.33 rejects this (AssertionError)")
    if meta.block_size != args.block_size:
        if args.block_size % meta.block_size:
            raise RuntimeError(f"Local block size {args.block_size} is not divisible by "
                               f"remote block size {meta.block_size} or vice versa.")
        raise RuntimeError(f"remote block size {meta.block_size} != local {args.block_size}: "
                           "vLLM splits blocks then; this peer does not")
    if meta.kv_cache_layout != LAYOUT:
        raise RuntimeError(
            f"Heterogeneous TP expects same kv_cache_layout (local {LAYOUT}, remote "
            f"{meta.kv_cache_layout}). Or enable experimental feature to receive LBHNC into a "
            "local LBNHC cache by setting 'enable_permute_local_kv'=True in "
            "--kv-transfer-config.")
    if len(meta.block_lens) != args.layers:
        raise RuntimeError("Number of KV layers must match between prefill and decode")
    remote_heads = max(1, args.kv_heads // args.remote_tp)
    for i, remote_len in enumerate(meta.block_lens):
        if mapping.replicated_remote:
            want = pool.page
        else:
            want = pool.page * remote_heads // pool.heads
        if remote_len != want:
            raise RuntimeError(f"SPLIT region {i}: remote P KV block_len {remote_len} must "
                               f"equal local {pool.page} * remote_heads {remote_heads} // "
                               f"local_heads {pool.heads}.")
    if first is not None and meta.num_blocks != first.num_blocks:
        raise RuntimeError("remote ranks of one engine disagree on num_blocks "
                           f"({first.num_blocks} vs {meta.num_blocks})")
    n = len(meta.kv_caches_base_addr)
    if len(meta.block_strides) != n or (meta.region_num_blocks is not None
                                       and len(meta.region_num_blocks) != n):
        raise RuntimeError("remote region lists have different lengths")
    if any(s < l for s, l in zip(meta.block_strides, meta.block_lens)):
        raise RuntimeError("remote block stride shorter than its block")


def strided(rows):
    """NIXL >= 1.5 strided descriptor rows (addr, len, dev, stride, count), as vLLM packs them."""
    return np.array(rows, dtype=np.uint64).reshape(-1, 5)


def cmd_decode(args):
    chash = compatibility_hash(args.model, args.kv_heads, args.head_dim, args.layers)
    if args.print_hash:
        emit({"compatibility_hash": chash})
        leave(0)
    blocks = [int(x) for x in args.blocks.split(",") if x != ""]
    if not 0 <= args.tp_rank < args.tp:
        sys.exit(f"nixl_pd_peer: --tp-rank {args.tp_rank} is outside --tp {args.tp}")
    if len(blocks) > args.num_blocks:
        sys.exit(f"nixl_pd_peer: {len(blocks)} blocks do not fit --num-blocks {args.num_blocks}")
    out = {"compatibility_hash": chash, "finished": False, "failed": False, "pattern_ok": None,
           "seconds": 0.0, "bytes_read": 0, "bytes_checked": 0}
    try:
        mapping = Mapping(args.tp, args.tp_rank, args.remote_tp, args.kv_heads)
    except ValueError as e:
        sys.exit(f"nixl_pd_peer: {e}")
    pool = Pool(args, args.tp, fill=False)
    agent = make_agent()
    register(agent, pool)
    # vLLM prepares every block of every local region once, at registration.
    local_rows = [(pool.region_base(r), pool.page, 0, pool.page, pool.num_blocks)
                  for r in range(args.layers)]
    t0 = time.time()
    try:
        metas = handshake(args, chash, mapping)
        first = None
        for rank in mapping.handshake_ranks:
            validate(args, mapping, pool, metas[rank], first)
            first = first or metas[rank]
    except RuntimeError as e:
        fail(out, t0, str(e))
    for b in blocks:
        if not 0 <= b < first.num_blocks:
            fail(out, t0, f"remote block {b} is outside the remote's {first.num_blocks} blocks")

    names = {rank: agent.add_remote_agent(metas[rank].agent_metadata)
             for rank in mapping.handshake_ranks}
    notif = f"{args.request_id}:{mapping.local_consumers}".encode()
    # vLLM's decode scheduler sends lease heartbeats "HB:<p request ids>" to every handshaked
    # rank while a request waits; --heartbeats sends that many first, to test a producer.
    for _ in range(args.heartbeats):
        for rank in mapping.handshake_ranks:
            agent.send_notif(names[rank], f"HB:{args.request_id}".encode())
    if not blocks:
        # A full prefix hit: no READ, only the notification (to each rank read from), so the
        # producer frees the request's blocks.
        for rank in mapping.read_ranks:
            agent.send_notif(names[rank], notif)
        out.update(finished=True, seconds=round(time.time() - t0, 3),
                   pattern_ok=True if args.check_pattern else None,
                   nonzero_bytes=int(np.count_nonzero(pool.mem)), bytes=len(pool.mem),
                   read_ranks=mapping.read_ranks, notif=notif.decode(), notify_only=True)
        time.sleep(NOTIF_LINGER_S)
        emit(out)
        leave(0)
    nreads = len(mapping.read_ranks)
    read_len = pool.page // nreads
    rank_offset = mapping.head_offset * pool.page
    local_ids = np.array([r * pool.num_blocks + i for r in range(args.layers)
                          for i in range(len(blocks))], dtype=np.int32)
    handles = []
    pieces = []  # (remote rank, local offset in block, remote offset in block, length)
    for slot, rank in enumerate(mapping.read_ranks):
        meta = metas[rank]
        rnb = meta.region_num_blocks or [meta.num_blocks] * len(meta.kv_caches_base_addr)
        # Remote list: per region, this rank's head slice of every remote block (D > P), or
        # the whole remote block (P > D: read_len is then the remote block's length).
        remote = agent.prep_xfer_dlist(names[rank], strided(
            [(base + rank_offset, read_len, meta.device_id, meta.block_strides[i], rnb[i])
             for i, base in enumerate(meta.kv_caches_base_addr)]), mem_type=MEM_TYPE)
        # Local list: the whole block, or (P > D) the slot this remote rank's heads fill.
        local_off = slot * read_len if mapping.tp_ratio < 0 else 0
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", strided(
            [(a + local_off, read_len, d, s, c) for a, _, d, s, c in local_rows]),
            mem_type=MEM_TYPE)
        region_starts = np.cumsum([0] + rnb[:-1])
        remote_ids = np.array([region_starts[r] + b for r in range(args.layers)
                               for b in blocks], dtype=np.int32)
        h = agent.make_prepped_xfer("READ", local, local_ids, remote, remote_ids,
                                    notif_msg=notif)
        if agent.transfer(h) == "ERR":
            fail(out, t0, f"posting the READ from remote rank {rank} failed")
        handles.append((rank, h))
        pieces.append((rank, local_off, rank_offset, read_len))

    pending = list(handles)
    while pending and time.time() - t0 < args.timeout:
        still = []
        for rank, h in pending:
            state = agent.check_xfer_state(h)
            if state == "ERR":
                fail(out, t0, f"the READ from remote rank {rank} failed")
            if state == "DONE":
                agent.release_xfer_handle(h)
            else:
                still.append((rank, h))
        pending = still
        if pending:
            time.sleep(0.0005)
    seconds = round(time.time() - t0, 3)
    finished = not pending
    out.update(finished=finished, seconds=seconds,
               bytes_read=len(blocks) * args.layers * read_len * len(pieces) if finished else 0)
    if args.check_pattern and finished:
        ok, checked = True, 0
        for r in range(args.layers):
            for i, b in enumerate(blocks):
                got = pool.block(r, i)
                for _, local_off, remote_off, length in pieces:
                    want = expected_fill(r, b, remote_off, length)
                    ok &= bool(np.array_equal(got[local_off:local_off + length], want))
                    checked += length
            # Local blocks past the request must not have been written.
            tail = pool.mem[r * pool.region_bytes + len(blocks) * pool.page:
                            (r + 1) * pool.region_bytes]
            ok &= not tail.any()
        out.update(pattern_ok=ok, bytes_checked=checked)
    out.update(nonzero_bytes=int(np.count_nonzero(pool.mem)), bytes=len(pool.mem),
               read_ranks=mapping.read_ranks, notif=notif.decode())
    if not finished:
        warn(f"READs from remote ranks {[r for r, _ in pending]} not done after {args.timeout} s")
    emit(out)
    good = finished and not out["failed"] and (not args.check_pattern or out["pattern_ok"])
    leave(0 if good else 1)


# --- CLI ------------------------------------------------------------------------------------


def shape_flags(p, engine_id, timeout):
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4, help="total KV heads of the model")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--num-blocks", type=int, default=16, help="blocks in this side's pool")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--model", default="toy/model")
    p.add_argument("--engine-id", default=engine_id)
    p.add_argument("--request-id", default="req-P")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prefill", help="serve the KV of every TP rank until R is read")
    p.add_argument("--port", type=int, default=0, help="side channel port; 0 picks a free one")
    shape_flags(p, "P-peer", 60)
    d = sub.add_parser("decode", help="one decode rank reading R from a prefill side channel")
    d.add_argument("--host", default="127.0.0.1")
    d.add_argument("--port", type=int, required=True)
    d.add_argument("--blocks", default="0", help="remote block ids; local block i gets the "
                   "i-th; empty: a full prefix hit (notification only, no READ)")
    d.add_argument("--heartbeats", type=int, default=0,
                   help="send this many HB:<request id> heartbeats to each rank first")
    d.add_argument("--remote-tp", type=int, default=1)
    d.add_argument("--tp-rank", type=int, default=0)
    d.add_argument("--check-pattern", action="store_true",
                   help="check every received byte against the prefill fill")
    d.add_argument("--print-hash", action="store_true",
                   help="print the compatibility hash for the shape and exit")
    shape_flags(d, "P", 30)
    args = ap.parse_args()
    for name in ("layers", "kv_heads", "head_dim", "block_size", "num_blocks", "tp"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.cmd == "prefill":
        cmd_prefill(args)
    else:
        if args.remote_tp < 1:
            ap.error("--remote-tp must be at least 1")
        cmd_decode(args)


if __name__ == "__main__":
    main()
