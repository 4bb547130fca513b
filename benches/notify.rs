//! What a decode rank pays to send one notification (`"<p_request_id>:<n>"`), over UCX
//! active messages (kvx's default, as NIXL does) next to ZMQ PUSH (the fallback), measured
//! in the same run; and the one-way delivery time of each (send until the receiver holds
//! the parsed message).
//!
//! The receiver lives in this process but behaves like a prefill rank between messages:
//! its UCX worker is armed (so the send also pays for waking it), and ZMQ's I/O threads
//! run as they would. Only the timed part differs per case: the send alone, or the send
//! plus delivery. The UCX build is found as kvx finds it (`KVX_UCX_LIB`, the project's
//! `.ucx/`, then the system's) and printed.
//!
//! Run: `cargo bench --bench notify`.

use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use kvx::transfer::notify::{Notification, NotifyListener, NotifySender, UcxNotifyReceiver, UcxNotifySender};
use kvx::transfer::ucx::{Context, ContextOptions, Endpoint, ErrMode, ProgressMode, Ucx, Worker};

const TIMEOUT: Duration = Duration::from_secs(5);

fn notif() -> Notification {
    Notification::Notif { p_request_id: "cmpl-7f3a9c1e2b4d4e0f8a6b5c4d3e2f1a0b-0".into(), count: 2 }
}

/// Progresses both workers until the receiver holds one message.
fn deliver(rx_worker: &Worker, tx_worker: &Worker, rx: &mut UcxNotifyReceiver) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        rx_worker.progress();
        tx_worker.progress();
        if !rx.drain().is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "an active message was not delivered within {TIMEOUT:?}");
    }
}

/// Leaves the receiver asleep-ready: armed, as a prefill rank waiting on its event fd.
fn arm(rx_worker: &Worker, rx: &mut UcxNotifyReceiver) {
    while !rx_worker.arm().expect("arm") {
        rx_worker.progress();
        rx.drain();
    }
}

fn bench(c: &mut Criterion) {
    let ucx = Ucx::load(None).expect("load UCX");
    eprintln!("UCX {} from {}", ucx.version(), ucx.path().display());
    let ctx = Context::new(
        &ucx,
        &ContextOptions { progress: ProgressMode::Hybrid, active_messages: true, ..Default::default() },
    )
    .expect("context");
    let rx_worker = Worker::new(&ctx).expect("receiver worker");
    let tx_worker = Worker::new(&ctx).expect("sender worker");
    let mut rx = UcxNotifyReceiver::new(&rx_worker).expect("receiver");
    let ep = Endpoint::connect(&tx_worker, &rx_worker.address().expect("address"), ErrMode::None)
        .expect("endpoint");
    eprintln!("UCX endpoint transports: {}", ep.transports().unwrap_or_default());
    let tx = UcxNotifySender::new(ep, "bench receiver", TIMEOUT);
    let n = notif();
    // Wire-up happens on the first message.
    tx.send(&n).expect("first send");
    deliver(&rx_worker, &tx_worker, &mut rx);

    let listener = NotifyListener::bind("tcp://127.0.0.1:0").expect("bind");
    let zmq_tx = NotifySender::connect(listener.endpoint(), TIMEOUT).expect("connect");
    zmq_tx.send(&n).expect("first send");
    listener.recv(TIMEOUT).expect("recv").expect("first message");

    let mut g = c.benchmark_group("notify");
    g.measurement_time(Duration::from_secs(4)).sample_size(60);
    g.bench_function("send/ucx_am", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                arm(&rx_worker, &mut rx);
                let t = Instant::now();
                tx.send(&n).expect("send");
                total += t.elapsed();
                deliver(&rx_worker, &tx_worker, &mut rx);
            }
            total
        })
    });
    g.bench_function("send/zmq_push", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                zmq_tx.send(&n).expect("send");
                total += t.elapsed();
                listener.recv(TIMEOUT).expect("recv").expect("delivered");
            }
            total
        })
    });
    g.bench_function("delivered/ucx_am", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                arm(&rx_worker, &mut rx);
                let t = Instant::now();
                tx.send(&n).expect("send");
                deliver(&rx_worker, &tx_worker, &mut rx);
                total += t.elapsed();
            }
            total
        })
    });
    g.bench_function("delivered/zmq_push", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                zmq_tx.send(&n).expect("send");
                listener.recv(TIMEOUT).expect("recv").expect("delivered");
                total += t.elapsed();
            }
            total
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
