//! `kvx bench`'s settings under test: flags, config files and the environment resolved, and
//! every refusal naming its flag.

use crate::transfer::memory::MemKind;
use std::io::Write as _;

use clap::{Args as _, FromArgMatches as _};

use super::*;
use crate::config::engine::KvMemory;
use crate::pipeline::wire::{self, ToWorker};
use crate::settings::layer::Layer as _;
use crate::transfer::memory::MemPlace;
use crate::transfer::ucx::{ErrMode, ProgressMode};
use crate::vocab::kinds::VerifyMode;

fn env() -> ProcessEnv {
    ProcessEnv {
        results_dir: None,
        stderr_is_terminal: false,
        launcher: Ok(None),
        exe: Ok(PathBuf::from("/usr/bin/kvx")),
    }
}

fn config(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new().suffix(".toml").tempfile().expect("temp file");
    f.write_all(text.as_bytes()).expect("write");
    f
}

fn with_config(file: &tempfile::NamedTempFile) -> BenchFlags {
    BenchFlags { config: Some(file.path().to_path_buf()), ..BenchFlags::default() }
}

/// `kvx bench`'s flags as clap parses them.
fn parse(args: &[&str]) -> Result<BenchFlags, clap::Error> {
    let cmd = BenchFlags::augment_args(clap::Command::new("bench").allow_negative_numbers(true));
    let matches = cmd.try_get_matches_from(std::iter::once("bench").chain(args.iter().copied()))?;
    BenchFlags::from_arg_matches(&matches)
}

#[test]
fn defaults_fill_what_neither_flag_nor_file_sets() {
    let s = resolve(&BenchFlags::default(), &env()).expect("defaults are valid");
    let w = &s.workers;
    assert_eq!((w.pair.p.tp, w.pair.d.tp), (1, 1));
    assert_eq!(w.pair.model.name, "llama-3.1-70b");
    assert_eq!(s.lens, PromptLens::Fixed(2048));
    assert_eq!(s.arrival, Arrival::Closed { concurrency: 2 });
    assert_eq!((s.requests, s.warmup, s.repeat), (Some(20), 2, 1));
    assert_eq!((w.lease, w.timeout), (Duration::from_secs(30), Duration::from_secs(5)));
    assert_eq!(w.transport.kind, TransportKind::Ucx);
    assert_eq!(w.transport.mode, TransferMode::Pull);
    assert_eq!(w.transport.err_mode, ErrMode::None);
    assert_eq!(w.transport.progress, ProgressMode::Hybrid);
    assert_eq!(w.transport.inflight, 64);
    assert_eq!(w.transport.notify, NotifyTransport::Ucx);
    assert_eq!(w.mem, KvMemory::Host);
    assert_eq!(s.on_failure, FailurePolicy::Fail);
    assert_eq!(s.name, "bench");
    assert_eq!(s.results_root, PathBuf::from("results"));
    assert_eq!((w.bind_host.as_str(), w.advertise_host.as_str()), ("127.0.0.1", "127.0.0.1"));
}

#[test]
fn nixl_keeps_its_own_error_mode_unless_told() {
    let nixl = |err_mode| BenchFlags {
        transport: Some(TransportKind::Nixl),
        ucx_mode: UcxModeFlags { err_mode, ..Default::default() },
        ..Default::default()
    };
    let err = |f: &BenchFlags| resolve(f, &env()).expect("valid").workers.transport.err_mode;
    assert_eq!(err(&nixl(None)), ErrMode::Peer, "NIXL's default, which vLLM keeps");
    assert_eq!(err(&nixl(Some(ErrMode::None))), ErrMode::None, "--err-mode applies to NIXL's backend");
    assert_eq!(err(&BenchFlags::default()), ErrMode::None, "kvx's UCX keeps UCX's default");
}

#[test]
fn flag_beats_file_beats_default() {
    let file = config(
        "name = \"tiny\"\nmodel = \"llama-3.1-8b\"\np_tp = 2\nd_tp = 1\ninflight = 8\nprogress = \"wait\"\n\
         err_mode = \"peer\"\nverify = \"off\"\nlease = \"10s\"\nprompt_len = 512\nconcurrency = 3\n",
    );
    let s = resolve(&with_config(&file), &env()).expect("valid");
    let w = &s.workers;
    assert_eq!(s.name, "tiny", "the file names the run");
    assert_eq!((w.pair.p.tp, w.pair.d.tp), (2, 1));
    assert_eq!(w.transport.inflight, 8);
    assert_eq!(w.transport.progress, ProgressMode::Wait);
    assert_eq!(w.transport.err_mode, ErrMode::Peer);
    assert_eq!(w.verify, VerifyMode::Off);
    assert_eq!(w.lease, Duration::from_secs(10));
    assert_eq!(s.lens, PromptLens::Fixed(512));
    assert_eq!(s.arrival, Arrival::Closed { concurrency: 3 });
    assert_eq!(w.timeout, Duration::from_secs(5), "the default where neither sets it");

    let flags = BenchFlags {
        run_name: crate::settings::flags::RunNameFlags { name: Some("mine".into()), ..Default::default() },
        pair: PairFlags { d_tp: Some(2), ..PairFlags::default() },
        inflight: Some(16),
        ucx_mode: UcxModeFlags {
            progress: Some(ProgressMode::Busy),
            err_mode: Some(ErrMode::None),
            ucx_tls: None,
        },
        verify: VerifyFlags { verify: Some(VerifyMode::Full) },
        lease: LeaseFlags { lease: Some(Duration::from_secs(3)) },
        prompt: crate::settings::flags::PromptLenFlags { prompt_len: Some("1024".into()) },
        arrival: crate::settings::flags::ArrivalFlags { concurrency: Some(1), ..Default::default() },
        ..with_config(&file)
    };
    let s = resolve(&flags, &env()).expect("valid");
    let w = &s.workers;
    assert_eq!(s.name, "mine");
    assert_eq!((w.pair.p.tp, w.pair.d.tp), (2, 2), "--d-tp over d_tp, p_tp from the file");
    assert_eq!(w.transport.inflight, 16);
    assert_eq!(w.transport.progress, ProgressMode::Busy);
    assert_eq!(w.transport.err_mode, ErrMode::None);
    assert_eq!(w.verify, VerifyMode::Full);
    assert_eq!(w.lease, Duration::from_secs(3));
    assert_eq!(s.lens, PromptLens::Fixed(1024));
    assert_eq!(s.arrival, Arrival::Closed { concurrency: 1 });
}

#[test]
fn environment_sits_between_defaults_and_flags() {
    let mut e = env();
    e.results_dir = Some("/tmp/from-env".into());
    e.stderr_is_terminal = true;
    let s = resolve(&BenchFlags::default(), &e).expect("valid");
    assert_eq!(s.results_root, PathBuf::from("/tmp/from-env"));
    assert!(s.progress_bar, "a bar only on a terminal");
    let flags = BenchFlags { results_dir: Some("/tmp/from-flag".into()), ..BenchFlags::default() };
    assert_eq!(resolve(&flags, &e).expect("valid").results_root, PathBuf::from("/tmp/from-flag"));
    e.exe = Err("deleted".into());
    assert_eq!(resolve(&BenchFlags::default(), &e).expect_err("no binary").flag, "(system)");
}

#[test]
fn each_bad_flag_is_named() {
    let cases: Vec<(BenchFlags, &str)> = vec![
        (BenchFlags { inflight: Some(0), ..Default::default() }, "--inflight"),
        (
            BenchFlags {
                devices: crate::settings::flags::DevicesFlags { devices: Some(vec![0]) },
                ..Default::default()
            },
            "--devices",
        ),
        (
            BenchFlags {
                mem: crate::settings::flags::MemFlags { mem: Some(MemKind::Cuda), ..Default::default() },
                devices: crate::settings::flags::DevicesFlags { devices: Some(vec![1, 1]) },
                ..Default::default()
            },
            "--devices",
        ),
        (
            BenchFlags {
                arrival: crate::settings::flags::ArrivalFlags { concurrency: Some(0), ..Default::default() },
                ..Default::default()
            },
            "--concurrency",
        ),
        (
            BenchFlags {
                arrival: crate::settings::flags::ArrivalFlags { rate: Some(-1.0), ..Default::default() },
                ..Default::default()
            },
            "--rate",
        ),
        (
            BenchFlags {
                arrival: crate::settings::flags::ArrivalFlags { requests: Some(0), ..Default::default() },
                ..Default::default()
            },
            "--requests",
        ),
        (
            BenchFlags {
                duration: crate::settings::flags::DurationFlags { duration: Some(Duration::ZERO) },
                ..Default::default()
            },
            "--duration",
        ),
        (
            BenchFlags {
                prefix_hit: crate::settings::flags::PrefixHitFlags { prefix_hit: Some(1.0) },
                ..Default::default()
            },
            "--prefix-hit",
        ),
        (BenchFlags { lease: LeaseFlags { lease: Some(Duration::ZERO) }, ..Default::default() }, "--lease"),
        (
            BenchFlags {
                timeout: crate::settings::flags::TimeoutFlags { timeout: Some(Duration::ZERO) },
                ..Default::default()
            },
            "--timeout",
        ),
        (
            BenchFlags {
                repeat: crate::settings::flags::RepeatFlags { repeat: Some(0) },
                ..Default::default()
            },
            "--repeat",
        ),
        (BenchFlags { slowdown: Some(f64::NAN), ..Default::default() }, "--slowdown"),
        (BenchFlags { fault: Some("kill-ucx:d0@1".into()), ..Default::default() }, "--fault"),
        (
            BenchFlags {
                listen: crate::settings::flags::ListenFlags { listen: Some("bogus".into()) },
                ..Default::default()
            },
            "--listen",
        ),
        (
            BenchFlags {
                transport: Some(TransportKind::Multi),
                transports: Some(vec![TransportKind::Storage]),
                ..Default::default()
            },
            "--transports",
        ),
        (
            BenchFlags {
                pool_blocks: crate::settings::flags::PoolBlocksFlags { pool_blocks: Some(1) },
                prompt: crate::settings::flags::PromptLenFlags { prompt_len: Some("1024".into()) },
                ..Default::default()
            },
            "--pool-blocks",
        ),
        (
            BenchFlags {
                pair: PairFlags { p_tp: Some(8), d_tp: Some(2), ..Default::default() },
                model: ModelFlags { num_kv_heads: Some(4), ..Default::default() },
                ..Default::default()
            },
            "--p-tp",
        ),
    ];
    for (flags, flag) in cases {
        let e = resolve(&flags, &env()).expect_err(flag);
        assert_eq!(e.flag, flag, "{flags:?}: {e}");
    }
    // Push mode resolves, and refuses what vLLM's push connector refuses, naming the flag.
    let push = resolve(
        &BenchFlags {
            mode: crate::settings::flags::ModeFlags { mode: Some(TransferMode::Push) },
            ..Default::default()
        },
        &env(),
    )
    .expect("push");
    assert_eq!(push.workers.transport.mode, TransferMode::Push);
    let e = resolve(
        &BenchFlags {
            mode: crate::settings::flags::ModeFlags { mode: Some(TransferMode::Push) },
            pair: PairFlags { p_block_size: Some(16), d_block_size: Some(32), ..Default::default() },
            ..Default::default()
        },
        &env(),
    )
    .expect_err("push needs equal block sizes");
    assert_eq!(e.flag, "--d-block-size", "{e}");
    let e = resolve(
        &BenchFlags {
            mode: crate::settings::flags::ModeFlags { mode: Some(TransferMode::Push) },
            transport: Some(TransportKind::Multi),
            ..Default::default()
        },
        &env(),
    )
    .expect_err("push writes over UCX");
    assert_eq!(e.flag, "--transport", "{e}");
    let e = resolve(
        &BenchFlags {
            mem: crate::settings::flags::MemFlags { mem: Some(MemKind::Cuda), ..Default::default() },
            transport: Some(TransportKind::Storage),
            ..Default::default()
        },
        &env(),
    )
    .expect_err("cuda pools over storage");
    assert_eq!(e.flag, "--transport", "{e}");
}

#[test]
fn cuda_batch_resolves_with_device_pools_and_refuses_what_it_cannot_do() {
    let batch = |more: BenchFlags| BenchFlags { transport: Some(TransportKind::CudaBatch), ..more };
    let cuda = || BenchFlags {
        mem: crate::settings::flags::MemFlags { mem: Some(MemKind::Cuda), ..Default::default() },
        ..Default::default()
    };
    if cfg!(feature = "cuda") {
        let s = resolve(&batch(cuda()), &env()).expect("cuda-batch on device pools");
        assert_eq!(s.workers.transport.kind, TransportKind::CudaBatch);
        assert_eq!(resolve(&batch(BenchFlags::default()), &env()).expect_err("host pools").flag, "--mem");
    } else {
        let e = resolve(&batch(cuda()), &env()).expect_err("no cuda feature");
        assert_eq!(e.flag, "--transport", "{e}");
    }
    let cases = [
        (
            BenchFlags {
                mode: crate::settings::flags::ModeFlags { mode: Some(TransferMode::Push) },
                ..cuda()
            },
            "--transport",
        ),
        (
            BenchFlags {
                listen: crate::settings::flags::ListenFlags { listen: Some("tcp://0.0.0.0:5700".into()) },
                ..cuda()
            },
            "--listen",
        ),
        (BenchFlags { advertise_host: Some("10.1.2.3".into()), ..cuda() }, "--advertise-host"),
        (BenchFlags { fault: Some("kill-ucx:p0@1".into()), ..cuda() }, "--fault"),
    ];
    for (flags, flag) in cases {
        let e = resolve(&batch(flags), &env()).expect_err(flag);
        // Without the cuda feature the transport itself is refused first (or push's check).
        if cfg!(feature = "cuda") || flag == "--transport" {
            assert_eq!(e.flag, flag, "{e}");
        }
    }
    // In a bench config file, as the other transports.
    let file = config("transport = \"cuda-batch\"\nmem = \"cuda\"\nbatch_copy = \"kernel\"");
    let got = resolve(&with_config(&file), &env());
    if cfg!(feature = "cuda") {
        let w = got.expect("config").workers;
        assert_eq!(w.transport.kind, TransportKind::CudaBatch);
        assert_eq!(w.transport.batch_copy, BatchCopy::Kernel);
    }
}

#[test]
fn device_descriptors_need_cuda_batch_the_kernel_and_the_plans_own_pairs() {
    let cuda = || BenchFlags {
        mem: crate::settings::flags::MemFlags { mem: Some(MemKind::Cuda), ..Default::default() },
        transport: Some(TransportKind::CudaBatch),
        batch_descriptors: Some(BatchDescriptors::Device),
        ..Default::default()
    };
    let e = resolve(
        &BenchFlags { batch_descriptors: Some(BatchDescriptors::Device), ..Default::default() },
        &env(),
    )
    .expect_err("ucx");
    assert_eq!(e.flag, "--batch-descriptors", "{e}");
    if !cfg!(feature = "cuda") {
        return;
    }
    let s = resolve(&cuda(), &env()).expect("device descriptors with the default kernel");
    assert_eq!(s.workers.transport.batch_descriptors, BatchDescriptors::Device);
    let api = BenchFlags { batch_copy: Some(BatchCopy::Api), ..cuda() };
    let e = resolve(&api, &env()).expect_err("the batch API takes no device descriptors");
    assert_eq!(e.flag, "--batch-descriptors", "{e}");
    assert!(e.to_string().contains("--batch-copy kernel"), "{e}");
    let e = resolve(&BenchFlags { coalesce: true, ..cuda() }, &env()).expect_err("coalesced");
    assert!(e.to_string().contains("--coalesce"), "{e}");
    let hybrid = BenchFlags {
        model: ModelFlags { model: Some("nemotron-h-8b".into()), ..ModelFlags::default() },
        prompt: crate::settings::flags::PromptLenFlags { prompt_len: Some("512".into()) },
        ..cuda()
    };
    let e = resolve(&hybrid, &env()).expect_err("a hybrid plan has no one region table");
    assert_eq!(e.flag, "--batch-descriptors", "{e}");
    assert!(e.to_string().contains("hybrid"), "{e}");
    let host = BenchFlags { batch_descriptors: None, ..cuda() };
    assert_eq!(
        resolve(&host, &env()).expect("default").workers.transport.batch_descriptors,
        BatchDescriptors::Host
    );
}

#[test]
fn batch_copy_is_cuda_batch_s_and_refused_elsewhere() {
    let cuda = || BenchFlags {
        mem: crate::settings::flags::MemFlags { mem: Some(MemKind::Cuda), ..Default::default() },
        ..Default::default()
    };
    let kernel = |more: BenchFlags| BenchFlags { batch_copy: Some(BatchCopy::Kernel), ..more };
    // Anywhere no cuda-batch run happens, by name (the flag, or its key in a file).
    let e = resolve(&kernel(BenchFlags::default()), &env()).expect_err("ucx");
    assert_eq!(e.flag, "--batch-copy", "{e}");
    assert!(e.to_string().contains("--transport cuda-batch"), "{e}");
    let file = config("batch_copy = \"kernel\"");
    let e = resolve(&with_config(&file), &env()).expect_err("ucx from a file");
    assert!(e.to_string().contains("batch_copy"), "names the key: {e}");
    if cfg!(feature = "cuda") {
        let batch = kernel(BenchFlags { transport: Some(TransportKind::CudaBatch), ..cuda() });
        let s = resolve(&batch, &env()).expect("cuda-batch with the kernel");
        assert_eq!(s.workers.transport.batch_copy, BatchCopy::Kernel);
        let plain = BenchFlags { transport: Some(TransportKind::CudaBatch), ..cuda() };
        let s = resolve(&plain, &env()).expect("cuda-batch");
        assert_eq!(s.workers.transport.batch_copy, BatchCopy::Kernel, "the default");
    }
}

#[test]
fn a_bad_choice_is_refused_by_the_parser_naming_its_flag() {
    for (args, flag) in [
        (&["--progress", "spin"][..], "--progress"),
        (&["--err-mode", "x"], "--err-mode"),
        (&["--verify", "maybe"], "--verify"),
        (&["--transport", "bogus"], "--transport"),
        (&["--on-load-failure", "retry"], "--on-load-failure"),
        (&["--mode", "poll"], "--mode"),
        (&["--mem", "disk"], "--mem"),
        (&["--alloc", "weird"], "--alloc"),
        (&["--overlap", "blocks"], "--overlap"),
        (&["--dispatch", "later"], "--dispatch"),
        (&["--compare-transports", "ucx,nccl"], "--compare-transports"),
        (&["--compare-modes", "pull,sideways"], "--compare-modes"),
        (&["--dtype", "fp7"], "--dtype"),
        (&["--vllm", "0.25"], "--vllm"),
    ] {
        let e = parse(args).expect_err(flag);
        use clap::error::ErrorKind::{InvalidValue, ValueValidation};
        assert!(matches!(e.kind(), InvalidValue | ValueValidation), "{args:?}: {e}");
        assert!(e.to_string().contains(flag), "{args:?}: {e}");
    }
    // The spellings users type today.
    let f = parse(&[
        "--mem",
        "cuda",
        "--transport",
        "cuda-batch",
        "--verify",
        "sample",
        "--err-mode",
        "peer",
        "--progress",
        "busy",
        "--alloc",
        "fragmented",
        "--on-load-failure",
        "recompute",
        "--overlap",
        "layers",
        "--dispatch",
        "concurrent",
        "--mode",
        "push",
        "--transports",
        "ucx,storage",
        "--vllm",
        "0.19",
        "--dtype",
        "bfloat16",
    ])
    .expect("valid");
    assert_eq!((f.mem.mem, f.transport), (Some(MemKind::Cuda), Some(TransportKind::CudaBatch)));
    assert_eq!(
        (f.verify.verify, f.ucx_mode.err_mode, f.ucx_mode.progress),
        (Some(VerifyMode::Sample), Some(ErrMode::Peer), Some(ProgressMode::Busy))
    );
    assert_eq!(
        (f.alloc.alloc, f.on_load_failure),
        (Some(AllocPattern::Fragmented), Some(FailurePolicy::Recompute))
    );
    assert_eq!(
        (f.overlap, f.dispatch.dispatch, f.mode.mode),
        (Some(Overlap::Layers), Some(Dispatch::Concurrent), Some(TransferMode::Push))
    );
    assert_eq!(f.transports, Some(vec![TransportKind::Ucx, TransportKind::Storage]));
    assert_eq!(f.pair.engine.vllm, Some(crate::topology::VllmVersion::V0_19));
    assert_eq!(f.model.dtype, Some(crate::settings::model::Dtype::Bf16));
    // --transports takes the members of multi's chain only.
    let e = resolve(&parse(&["--transports", "ucx,multi"]).expect("parses"), &env()).expect_err("multi");
    assert_eq!(e.to_string(), "'multi' is not ucx or storage (change --transports)");
}

#[test]
fn each_bad_config_value_names_its_key_and_file() {
    for (text, key) in [
        ("inflight = 0", "inflight"),
        ("progress = \"spin\"", "progress"),
        ("err_mode = \"x\"", "err_mode"),
        ("verify = \"maybe\"", "verify"),
        ("transport = \"bogus\"", "transport"),
        ("mode = \"sideways\"", "mode"),
        ("mem = \"gpu\"", "mem"),
        ("lease = \"0s\"", "lease"),
        ("timeout = \"forever\"", "timeout"),
        ("duration = \"0s\"", "duration"),
        ("prompt_len = 0", "prompt_len"),
        ("concurrency = 0", "concurrency"),
        ("repeat = 0", "repeat"),
        ("alloc = \"weird\"", "alloc"),
        ("p_tp = 8\nd_tp = 2\nnum_kv_heads = 4", "p_tp"),
        ("layout = \"XYZ\"", "layout"),
        ("dtype = \"fp7\"", "dtype"),
        ("vllm = \"0.25\"", "vllm"),
        ("on_load_failure = \"retry\"", "on_load_failure"),
        ("transports = [\"nccl\"]", "transports"),
        ("overlap = \"blocks\"", "overlap"),
        ("inflight = \"x\"", "inflight"),
    ] {
        let file = config(text);
        let e = resolve(&with_config(&file), &env()).expect_err(text);
        assert_eq!(e.flag, format!("{key} in {}", file.path().display()), "{text}: {e}");
    }
    // The same key given as a flag too: the flag's value is the one at fault.
    let file = config("inflight = 8");
    let flags = BenchFlags { inflight: Some(0), ..with_config(&file) };
    assert_eq!(resolve(&flags, &env()).expect_err("flag").flag, "--inflight");
    // An unknown key is refused as a whole file.
    let file = config("inflite = 8");
    assert_eq!(resolve(&with_config(&file), &env()).expect_err("typo").flag, "--config");
}

#[test]
fn the_shipped_bench_configs_parse_unchanged() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench-configs");
    for name in ["ci", "p8d2", "mla-deepseek", "block-size-sweep", "frag-sweep", "layout-sweep"] {
        let path = dir.join(format!("{name}.toml"));
        let file: BenchFlags = layer::load(&path, "--config").unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(file.gives("p_tp").is_some(), "{name}");
    }
    // The hybrid ones resolve to a hybrid pair (vLLM's planner accepts them).
    for name in ["hybrid-qwen3-next", "hybrid-nemotron-h", "sliding-gpt-oss"] {
        let flags = BenchFlags { config: Some(dir.join(format!("{name}.toml"))), ..Default::default() };
        let s = resolve(&flags, &env()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let h = s.workers.hybrid.as_ref().unwrap_or_else(|| panic!("{name}: a hybrid pair"));
        assert_eq!(s.workers.pair.model.name, h.model.name, "{name}");
        assert!(h.p.num_blocks > 1 && h.d.num_blocks > 1, "{name}");
    }
}

/// What kvx bench does not move for hybrid models yet is refused, naming the flag; a flag
/// that applies only to hybrid models is refused for a uniform one.
#[test]
fn hybrid_bench_refusals_name_their_flags() {
    let hybrid = |extra: BenchFlags| BenchFlags {
        model: ModelFlags { model: Some("nemotron-h-8b".into()), ..ModelFlags::default() },
        prompt: crate::settings::flags::PromptLenFlags { prompt_len: Some("512".into()) },
        ..extra
    };
    let refused = |flags: BenchFlags| resolve(&flags, &env()).expect_err("refused").flag;
    // Push: accepted over UCX, written after the whole prefill, its own refusals.
    let push = |more: BenchFlags| BenchFlags {
        mode: crate::settings::flags::ModeFlags { mode: Some(TransferMode::Push) },
        ..more
    };
    let s = resolve(&hybrid(push(BenchFlags::default())), &env()).expect("hybrid push");
    assert_eq!(s.workers.transport.mode, TransferMode::Push);
    let layers = BenchFlags { overlap: Some(Overlap::Layers), ..Default::default() };
    assert_eq!(refused(hybrid(push(layers))), "--overlap");
    let rule = || BenchFlags {
        push_attention: crate::settings::flags::PushAttentionFlags {
            push_attention: Some(crate::layouts::hybrid::write_plan::PushAttention::EveryRank),
        },
        ..Default::default()
    };
    assert_eq!(refused(hybrid(rule())), "--push-attention");
    let gemma = BenchFlags {
        model: ModelFlags { model: Some("gemma-3-4b".into()), ..ModelFlags::default() },
        prompt: crate::settings::flags::PromptLenFlags { prompt_len: Some("512".into()) },
        pair: PairFlags { p_tp: Some(1), d_tp: Some(8), ..PairFlags::default() },
        ..push(BenchFlags::default())
    };
    assert_eq!(refused(gemma), "--d-tp");
    let uniform = BenchFlags {
        prompt: crate::settings::flags::PromptLenFlags { prompt_len: Some("512".into()) },
        ..push(rule())
    };
    assert_eq!(refused(uniform), "--push-attention");
    let storage = BenchFlags { transport: Some(TransportKind::Storage), ..Default::default() };
    assert_eq!(refused(hybrid(storage)), "--transport");
    // cuda-batch copies device pools: host pools and host buffers are refused as for a
    // uniform model, device pools are taken.
    let batch = |more: BenchFlags| BenchFlags { transport: Some(TransportKind::CudaBatch), ..more };
    let cuda = || BenchFlags {
        mem: crate::settings::flags::MemFlags { mem: Some(MemKind::Cuda), ..Default::default() },
        ..Default::default()
    };
    if cfg!(feature = "cuda") {
        assert_eq!(refused(hybrid(batch(BenchFlags::default()))), "--mem");
        let staged =
            BenchFlags { kv_buffer: KvBufferFlags { kv_buffer_device: Some(KvBufferDevice::Cpu) }, ..cuda() };
        assert_eq!(refused(hybrid(batch(staged))), "--kv-buffer-device");
        let s = resolve(&hybrid(batch(cuda())), &env()).expect("a hybrid model over cuda-batch");
        assert_eq!(s.workers.transport.kind, TransportKind::CudaBatch);
        assert!(s.workers.hybrid.is_some());
    } else {
        assert_eq!(refused(hybrid(batch(cuda()))), "--transport");
    }
    let copy = BenchFlags {
        hybrid_rules: crate::settings::flags::HybridRuleFlags {
            host_copy: Some(crate::layouts::hybrid::HostCopyRule::PerGroup),
            ..Default::default()
        },
        ..Default::default()
    };
    assert_eq!(refused(hybrid(copy.clone())), "--host-copy");
    assert_eq!(refused(copy), "--host-copy");
    let cpu = BenchFlags {
        kv_buffer: KvBufferFlags { kv_buffer_device: Some(KvBufferDevice::Cpu) },
        hybrid_rules: crate::settings::flags::HybridRuleFlags {
            host_state_page: Some(crate::layouts::hybrid::HostStatePage::Padded),
            ..Default::default()
        },
        ..Default::default()
    };
    let staged = resolve(&hybrid(cpu), &env()).expect("a hybrid bench through host buffers");
    let pair = staged.workers.hybrid.as_ref().expect("hybrid");
    assert!(pair.d.host_state_page_padded && pair.d.kv_buffer_device == KvBufferDevice::Cpu);
    // vLLM's own refusal: Nemotron-H's 8 groups do not split over TP 3... nor do its heads.
    let tp3 = BenchFlags { pair: PairFlags { d_tp: Some(3), ..PairFlags::default() }, ..Default::default() };
    assert_eq!(refused(hybrid(tp3)), "--d-tp");
    let exact = BenchFlags {
        hybrid_rules: crate::settings::flags::HybridRuleFlags {
            state_slices: Some(crate::layouts::hybrid::StateSlices::Exact),
            ..Default::default()
        },
        ..Default::default()
    };
    assert_eq!(refused(exact), "--state-slices");
    // A pool too small for one request.
    let small = BenchFlags {
        pool_blocks: crate::settings::flags::PoolBlocksFlags { pool_blocks: Some(2) },
        ..Default::default()
    };
    assert_eq!(refused(hybrid(small)), "--pool-blocks");
    let ok = resolve(&hybrid(BenchFlags::default()), &env()).expect("a hybrid bench");
    assert!(ok.workers.hybrid.is_some());
}

#[test]
fn memory_and_devices() {
    let one = BenchFlags {
        mem: crate::settings::flags::MemFlags { mem: Some(MemKind::Cuda), ..Default::default() },
        devices: crate::settings::flags::DevicesFlags { devices: Some(vec![3]) },
        ..Default::default()
    };
    let s = resolve(&one, &env()).expect("cuda pools on device 3");
    assert_eq!(s.workers.mem, KvMemory::Cuda { devices: vec![3] });
    let file = config("mem = \"cuda\"\ndevices = [0, 1]");
    let s = resolve(&with_config(&file), &env()).expect("devices from the file");
    assert_eq!(s.workers.mem, KvMemory::Cuda { devices: vec![0, 1] });
    // A flag beats the file.
    let flags = BenchFlags {
        devices: crate::settings::flags::DevicesFlags { devices: Some(vec![2]) },
        ..with_config(&file)
    };
    assert_eq!(resolve(&flags, &env()).expect("flag wins").workers.mem, KvMemory::Cuda { devices: vec![2] });
    let file = config("mem = \"cuda\"\ntransport = \"storage\"");
    let e = resolve(&with_config(&file), &env()).expect_err("device pools over files");
    assert!(e.flag.contains("transport"), "{e}");
}

#[test]
fn engines_carry_typed_settings_and_placements() {
    let flags = BenchFlags {
        pair: PairFlags { p_tp: Some(2), d_tp: Some(2), ..PairFlags::default() },
        model: ModelFlags { model: Some("llama-3.1-8b".into()), ..ModelFlags::default() },
        ucx_mode: UcxModeFlags { progress: Some(ProgressMode::Wait), ..UcxModeFlags::default() },
        listen: crate::settings::flags::ListenFlags { listen: Some("tcp://0.0.0.0:7000".into()) },
        ..BenchFlags::default()
    };
    let s = resolve(&flags, &env()).expect("valid");
    let p = s.engine(Role::Prefill);
    let d = s.engine(Role::Decode);
    assert_eq!(p.mem, [MemPlace::Host; 2]);
    assert_eq!(p.worker.transport.progress, ProgressMode::Wait);
    assert!(
        matches!(&p.launch, crate::config::engine::Launch::External { bind } if bind == "tcp://0.0.0.0:7000")
    );
    assert!(
        matches!(&d.launch, crate::config::engine::Launch::External { bind } if bind == "tcp://0.0.0.0:7001")
    );
    assert_eq!(p.side_channel_bind.as_deref(), Some("tcp://0.0.0.0:0"));
    assert_eq!(d.side_channel_bind, None);
    assert_eq!((p.seed, d.seed), (0, 1));
    // Port 0: both engines take a free port (the same for bench and bench --serve).
    let zero = BenchFlags {
        listen: crate::settings::flags::ListenFlags { listen: Some("tcp://0.0.0.0:0".into()) },
        ..flags
    };
    let d = resolve(&zero, &env()).expect("valid").engine(Role::Decode);
    assert!(
        matches!(&d.launch, crate::config::engine::Launch::External { bind } if bind == "tcp://0.0.0.0:0")
    );
}

#[test]
fn typed_worker_config_round_trips_through_the_control_protocol() {
    let flags = BenchFlags {
        transport: Some(TransportKind::Multi),
        ucx_mode: UcxModeFlags {
            err_mode: Some(ErrMode::Peer),
            progress: Some(ProgressMode::Busy),
            ucx_tls: None,
        },
        verify: VerifyFlags { verify: Some(VerifyMode::Sample) },
        notify: Some(NotifyTransport::Zmq),
        ..BenchFlags::default()
    };
    let s = resolve(&flags, &env()).expect("valid");
    let mut cfg = s.engine(Role::Decode).worker;
    cfg.rank = 1;
    cfg.mem = MemPlace::Cuda { device: 3 };
    let msg = ToWorker::Init(Box::new(cfg.clone()));
    let back: ToWorker = wire::decode(&wire::encode(&msg)).expect("decodes");
    assert_eq!(back, msg);
    let ToWorker::Init(got) = back else { panic!("an Init") };
    assert_eq!(got.transport.err_mode, ErrMode::Peer);
    assert_eq!(got.transport.progress, ProgressMode::Busy);
    assert_eq!(got.transport.kind, TransportKind::Multi);
    assert_eq!(got.transport.chain, [TransportKind::Ucx, TransportKind::Storage]);
    assert_eq!(got.transport.mode, TransferMode::Pull);
    assert_eq!(got.mem, MemPlace::Cuda { device: 3 });
    // Enums travel as names, not as strings kvx parses again: a wrong name does not decode.
    let text = String::from_utf8_lossy(&wire::encode(&msg)).into_owned();
    assert!(text.contains("busy") && text.contains("peer") && text.contains("cuda"), "{text}");
}

#[test]
fn scenario_records_the_choices_by_name() {
    let s = resolve(
        &BenchFlags { on_load_failure: Some(FailurePolicy::Recompute), ..Default::default() },
        &env(),
    )
    .expect("valid");
    let sc = crate::report::scenario::bench_scenario(&s);
    assert_eq!(sc.verify, Some(VerifyMode::Sample), "20 requests of 640 MiB: more than 2 GiB");
    assert_eq!(sc.transport.as_deref(), Some("ucx"));
    assert_eq!(sc.mem.as_deref(), Some("host"));
    assert_eq!(sc.on_load_failure.as_deref(), Some("recompute"));
    assert_eq!(sc.extra.progress, Some(crate::transfer::ucx::ProgressMode::Hybrid));
}

#[test]
fn prefill_simulation_overlap_and_dispatch_resolve_and_refuse_by_flag() {
    let push = |f: BenchFlags| BenchFlags {
        mode: crate::settings::flags::ModeFlags { mode: Some(TransferMode::Push) },
        ..f
    };
    // Defaults: no simulated prefill, no overlap, sequential.
    let s = resolve(&push(BenchFlags::default()), &env()).expect("push");
    assert_eq!((s.workers.prefill.per_layer_ns, s.workers.prefill.overlap), (0, Overlap::None));
    assert_eq!(s.dispatch, Dispatch::Sequential);
    // Layer overlap dispatches both legs at once unless told otherwise.
    let layers = push(BenchFlags {
        overlap: Some(Overlap::Layers),
        prefill_time_per_layer: Some(Duration::from_micros(500)),
        ..Default::default()
    });
    let s = resolve(&layers, &env()).expect("overlap");
    assert_eq!((s.workers.prefill.per_layer_ns, s.workers.prefill.overlap), (500_000, Overlap::Layers));
    assert_eq!(s.dispatch, Dispatch::Concurrent);
    assert_eq!(
        crate::report::scenario::bench_scenario(&s).extra.overlap,
        Some(crate::config::worker::Overlap::Layers)
    );
    let refused = |f: BenchFlags| resolve(&f, &env()).expect_err("refused").flag;
    assert_eq!(
        refused(BenchFlags {
            dispatch: crate::settings::flags::DispatchFlags { dispatch: Some(Dispatch::Sequential) },
            ..layers.clone()
        }),
        "--dispatch"
    );
    assert_eq!(
        refused(BenchFlags { prefill_time_per_layer: Some(Duration::from_secs(2)), ..layers.clone() }),
        "--prefill-time-per-layer"
    );
    // BHLNC with several heads per rank keeps a block's layers inside each head: nothing to
    // cut per layer. BLHNC registers one strided region per layer, so it can.
    let layout = |l: &str| BenchFlags {
        pair: PairFlags {
            engine: crate::settings::flags::EngineFlags { layout: Some(l.into()), ..Default::default() },
            ..PairFlags::default()
        },
        ..layers.clone()
    };
    assert_eq!(refused(layout("BHLNC")), "--layout");
    assert!(resolve(&layout("BLHNC"), &env()).is_ok());
    // Pull refuses push's choices, except as the pull run of a mode comparison.
    let pull = BenchFlags {
        mode: crate::settings::flags::ModeFlags { mode: Some(TransferMode::Pull) },
        ..layers.clone()
    };
    assert_eq!(refused(pull.clone()), "--overlap");
    assert_eq!(
        refused(BenchFlags {
            mode: crate::settings::flags::ModeFlags { mode: None },
            dispatch: crate::settings::flags::DispatchFlags { dispatch: Some(Dispatch::Concurrent) },
            ..BenchFlags::default()
        }),
        "--dispatch"
    );
    let leg = resolve(&BenchFlags { in_mode_comparison: true, ..pull }, &env()).expect("comparison leg");
    assert_eq!((leg.workers.prefill.overlap, leg.dispatch), (Overlap::None, Dispatch::Sequential));
    assert_eq!(leg.workers.prefill.per_layer_ns, 500_000, "both modes compute the same prefill");
    // From the file, the error names the key.
    let file = config("mode = \"pull\"\noverlap = \"layers\"\nprefill_time_per_layer = \"1ms\"\n");
    let e = resolve(&with_config(&file), &env()).expect_err("pull with overlap");
    assert!(e.flag.starts_with("overlap in "), "{}", e.flag);
}

#[test]
fn faults_parse() {
    assert_eq!(
        parse_fault("kill-ucx:p0@5"),
        Ok(FaultPlan { fault: Fault::KillUcx, role: Role::Prefill, rank: 0, after: 5 })
    );
    assert_eq!(parse_fault("exit:d1@2").map(|f| f.role), Ok(Role::Decode));
    assert!(parse_fault("exit:x1@2").is_err());
}

#[test]
fn the_launcher_travels_to_the_report_and_a_refused_one_stops_the_run() {
    let lws = crate::vocab::launcher::Launcher::LeaderWorkerSet {
        worker_index: 0,
        group_size: 4,
        leader_address: "kvx-bench-0.kvx-bench.default".into(),
    };
    let s = resolve(&BenchFlags::default(), &ProcessEnv { launcher: Ok(Some(lws.clone())), ..env() })
        .expect("ok");
    assert_eq!(s.launcher, Some(lws));
    let refused = crate::error::ConfigError::new("SLURM_PROCID or RANK", "both are set");
    let e = resolve(&BenchFlags::default(), &ProcessEnv { launcher: Err(refused.clone()), ..env() })
        .expect_err("refused");
    assert_eq!(e, refused);
}
