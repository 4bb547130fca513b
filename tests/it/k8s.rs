//! The Kubernetes manifests of `deploy/kubernetes/`, checked without a cluster.
//!
//! - Every manifest validates against its schema: the CRDs LeaderWorkerSet, DisaggregatedSet
//!   and Grove publish, and the Kubernetes core schemas (`deploy/kubernetes/schemas/`).
//! - Each bench manifest's pods run here, one process per pod, in two network namespaces
//!   (prefill pods in one, the bench and decode pods in the other, as in `netns.rs`), each
//!   with exactly the environment its pod gets: the variables the launcher's controller
//!   injects (computed by its rules from the manifest: name, size, index), the manifest's own
//!   `env` (`status.podIP` being the namespace's address) and its container command. The
//!   names pods reach each other by resolve as cluster DNS would (`/etc/netns/NS/hosts`).
//!   What differs from a pod, and only this: a volume's mount path is a temp directory (the
//!   ConfigMap's files written there), `kvx` and a `sleep` that returns at once are first on
//!   `PATH` (a pod sleeps after its run so its log can be read), and UCX is held to tcp on the
//!   veth link (both namespaces share one kernel).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::netns::{RUN_TIMEOUT, STEP_TIMEOUT, Side, TwoHosts, check_across};
use crate::procs::{Spawned, exclusive, kvx_path, n};
use crate::ucx_common::{Part, skip};
use kvx::settings::env::{Launcher, resolve_launcher};

/// The namespace the launchers' DNS names use (the manifests name none: `default`).
const NAMESPACE: &str = "default";

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes")
}

/// The documents of a YAML file, as JSON values.
fn documents(path: &Path) -> Vec<Value> {
    use serde::Deserialize as _;
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: not YAML: {e}", path.display())))
        .filter(|v| !v.is_null())
        .collect()
}

fn kind<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter().find(|d| d["kind"] == kind).unwrap_or_else(|| panic!("no {kind} in {docs:?}"))
}

fn s(v: &Value) -> String {
    v.as_str().unwrap_or_else(|| panic!("not a string: {v}")).to_string()
}

/// Where a pod runs: the bench with the decode ranks (the orchestrator away from the
/// prefill ranks, as in `netns.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Host {
    Prefill,
    Decode,
}

/// One pod as it would start: its launcher-injected and own environment, its container's
/// command, and its volumes.
#[derive(Debug, Clone)]
struct Pod {
    name: String,
    host: Host,
    /// The launcher's variables, in the order its controller injects them.
    injected: Vec<(String, String)>,
    /// The container's own `env` (value or `fieldRef`).
    own_env: Vec<(String, Value)>,
    command: Vec<String>,
    /// mountPath -> the files a ConfigMap puts there (empty for an emptyDir).
    mounts: Vec<(String, BTreeMap<String, String>)>,
}

impl Pod {
    fn from_template(
        name: String,
        host: Host,
        injected: Vec<(String, String)>,
        spec: &Value,
        docs: &[Value],
    ) -> Pod {
        let c = &spec["containers"][0];
        let command: Vec<String> = ["command", "args"]
            .iter()
            .flat_map(|k| c[*k].as_array().cloned().unwrap_or_default())
            .map(|v| s(&v))
            .collect();
        let own_env = c["env"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|e| (s(&e["name"]), e.get("value").cloned().unwrap_or_else(|| e["valueFrom"].clone())))
            .collect();
        let volumes = spec["volumes"].as_array().cloned().unwrap_or_default();
        let mounts = c["volumeMounts"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|m| {
                let vol = volumes.iter().find(|v| v["name"] == m["name"]).expect("a volume for the mount");
                let files = match vol["configMap"]["name"].as_str() {
                    Some(cm) => {
                        let map = docs
                            .iter()
                            .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == cm)
                            .unwrap_or_else(|| panic!("{name}: no ConfigMap {cm} in the manifest"));
                        map["data"]
                            .as_object()
                            .expect("data")
                            .iter()
                            .map(|(k, v)| (k.clone(), s(v)))
                            .collect()
                    }
                    None => BTreeMap::new(),
                };
                (s(&m["mountPath"]), files)
            })
            .collect();
        Pod { name, host, injected, own_env, command, mounts }
    }

    /// The pod's environment, `status.podIP` being `ip`.
    fn env(&self, ip: &str) -> Vec<(String, String)> {
        let mut env = self.injected.clone();
        for (k, v) in &self.own_env {
            let value = match v {
                Value::String(s) => s.clone(),
                v if v["fieldRef"]["fieldPath"] == "status.podIP" => ip.to_string(),
                v => panic!("{}: {k} from {v}: the test knows status.podIP only", self.name),
            };
            env.push((k.clone(), value));
        }
        env
    }

    fn launcher(&self) -> Result<Option<Launcher>, kvx::error::ConfigError> {
        let env = self.env("10.0.0.1");
        resolve_launcher(|k| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    }
}

/// A bench manifest's pods, and the DNS names they reach the bench pod by.
struct Cluster {
    pods: Vec<Pod>,
    bench_names: Vec<String>,
}

/// `--p-tp P` in a command.
fn p_tp(command: &[String]) -> u32 {
    let text = command.join(" ");
    let mut words = text.split_whitespace();
    words.by_ref().find(|w| *w == "--p-tp").expect("--p-tp in the bench command");
    words.next().and_then(|w| w.parse().ok()).expect("a number after --p-tp")
}

/// LeaderWorkerSet: group 0 of `size` pods, the leader's template for pod 0. The controller
/// injects LWS_LEADER_ADDRESS (`<lws>-<group>.<subdomain = the lws>.<namespace>`),
/// LWS_GROUP_SIZE and LWS_WORKER_INDEX (kubernetes-sigs/lws `pkg/utils/pod`).
fn lws_pods(docs: &[Value]) -> Cluster {
    let lws = kind(docs, "LeaderWorkerSet");
    let name = s(&lws["metadata"]["name"]);
    let t = &lws["spec"]["leaderWorkerTemplate"];
    let size = t["size"].as_u64().expect("size") as u32;
    let leader = format!("{name}-0.{name}.{NAMESPACE}");
    let p = p_tp(
        &Pod::from_template(String::new(), Host::Decode, vec![], &t["leaderTemplate"]["spec"], docs).command,
    );
    let pods = (0..size)
        .map(|i| {
            let template = if i == 0 { &t["leaderTemplate"] } else { &t["workerTemplate"] };
            let host = if i >= 1 && i - 1 < p { Host::Prefill } else { Host::Decode };
            let injected = vec![
                ("LWS_LEADER_ADDRESS".to_string(), leader.clone()),
                ("LWS_GROUP_SIZE".to_string(), size.to_string()),
                ("LWS_WORKER_INDEX".to_string(), i.to_string()),
            ];
            Pod::from_template(format!("{name}-0-{i}"), host, injected, &template["spec"], docs)
        })
        .collect();
    Cluster { pods, bench_names: vec![leader] }
}

/// Indexed Job: `completions` pods of one template; Kubernetes sets JOB_COMPLETION_INDEX and
/// the host name `<job>-<index>` (the subdomain being the headless Service).
fn indexed_job_pods(docs: &[Value]) -> Cluster {
    let job = kind(docs, "Job");
    let name = s(&job["metadata"]["name"]);
    let spec = &job["spec"];
    assert_eq!(spec["completionMode"], "Indexed");
    let n = spec["completions"].as_u64().expect("completions") as u32;
    let template = &spec["template"]["spec"];
    let subdomain = s(&template["subdomain"]);
    let svc = kind(docs, "Service");
    assert_eq!(svc["metadata"]["name"], subdomain.as_str(), "the subdomain is the headless Service");
    assert_eq!(svc["spec"]["clusterIP"], "None");
    let p = p_tp(&Pod::from_template(String::new(), Host::Decode, vec![], template, docs).command);
    let pods = (0..n)
        .map(|i| {
            let host = if i >= 1 && i - 1 < p { Host::Prefill } else { Host::Decode };
            let injected = vec![
                ("JOB_COMPLETION_INDEX".to_string(), i.to_string()),
                ("HOSTNAME".to_string(), format!("{name}-{i}")),
            ];
            Pod::from_template(format!("{name}-{i}"), host, injected, template, docs)
        })
        .collect();
    Cluster { pods, bench_names: vec![format!("{name}-0.{subdomain}")] }
}

/// Grove PodCliqueSet replica 0: each clique's pods, with GROVE_PCS_NAME, GROVE_PCS_INDEX,
/// GROVE_PCLQ_NAME (`<pcs>-<index>-<clique>`), GROVE_HEADLESS_SERVICE (`<pcs>-<index>.<ns>.svc.
/// cluster.local`) and GROVE_PCLQ_POD_INDEX (ai-dynamo/grove's environment reference); a pod's
/// DNS name is `<pclq>-<pod index>.<headless service>`.
fn grove_pods(docs: &[Value]) -> Cluster {
    let pcs = kind(docs, "PodCliqueSet");
    let name = s(&pcs["metadata"]["name"]);
    let service = format!("{name}-0.{NAMESPACE}.svc.cluster.local");
    let mut pods = vec![];
    for clique in pcs["spec"]["template"]["cliques"].as_array().expect("cliques") {
        let c = s(&clique["name"]);
        let host = if c == "prefill" { Host::Prefill } else { Host::Decode };
        for i in 0..clique["spec"]["replicas"].as_u64().expect("replicas") as u32 {
            let injected = vec![
                ("GROVE_PCS_NAME".to_string(), name.clone()),
                ("GROVE_PCS_INDEX".to_string(), "0".to_string()),
                ("GROVE_PCLQ_NAME".to_string(), format!("{name}-0-{c}")),
                ("GROVE_HEADLESS_SERVICE".to_string(), service.clone()),
                ("GROVE_PCLQ_POD_INDEX".to_string(), i.to_string()),
            ];
            pods.push(Pod::from_template(
                format!("{name}-0-{c}-{i}"),
                host,
                injected,
                &clique["spec"]["podSpec"],
                docs,
            ));
        }
    }
    Cluster { pods, bench_names: vec![format!("{name}-0-bench-0.{service}")] }
}

/// DisaggregatedSet: each role a LeaderWorkerSet (its name is the controller's to choose; the
/// test calls it `<set>-<role>`), pods reaching the bench through the manifest's Service.
fn disaggregated_pods(docs: &[Value]) -> Cluster {
    let ds = kind(docs, "DisaggregatedSet");
    let set = s(&ds["metadata"]["name"]);
    let mut pods = vec![];
    for role in ds["spec"]["roles"].as_array().expect("roles") {
        let r = s(&role["name"]);
        let t = &role["spec"]["leaderWorkerTemplate"];
        let size = t["size"].as_u64().expect("size") as u32;
        let lws = format!("{set}-{r}");
        for i in 0..size {
            let template = if i == 0 && t.get("leaderTemplate").is_some() {
                &t["leaderTemplate"]
            } else {
                &t["workerTemplate"]
            };
            let injected = vec![
                ("LWS_LEADER_ADDRESS".to_string(), format!("{lws}-0.{lws}.{NAMESPACE}")),
                ("LWS_GROUP_SIZE".to_string(), size.to_string()),
                ("LWS_WORKER_INDEX".to_string(), i.to_string()),
            ];
            let host = if r == "prefill" { Host::Prefill } else { Host::Decode };
            pods.push(Pod::from_template(format!("{lws}-0-{i}"), host, injected, &template["spec"], docs));
        }
    }
    let svc = docs.iter().find(|d| d["kind"] == "Service").expect("the bench's Service");
    Cluster { pods, bench_names: vec![s(&svc["metadata"]["name"])] }
}

fn cluster(manifest: &str) -> Cluster {
    let docs = documents(&deploy_dir().join(manifest));
    match manifest {
        "bench-lws.yaml" => lws_pods(&docs),
        "bench-indexed-job.yaml" => indexed_job_pods(&docs),
        "bench-grove.yaml" => grove_pods(&docs),
        "bench-disaggregatedset.yaml" => disaggregated_pods(&docs),
        other => panic!("no pods for {other}"),
    }
}

const BENCH_MANIFESTS: [&str; 4] =
    ["bench-lws.yaml", "bench-indexed-job.yaml", "bench-grove.yaml", "bench-disaggregatedset.yaml"];

/// The launcher each pod's environment gives, as kvx resolves it: the one the manifest means,
/// at the index the test runs the pod as (so the environment the run below uses is the one
/// the manifest gives, read from it, never typed here).
#[test]
fn each_manifest_gives_its_pods_the_launcher_and_index_kvx_reads() {
    for manifest in BENCH_MANIFESTS {
        let c = cluster(manifest);
        assert!(c.pods.len() >= 4, "{manifest}: P2 -> D1 and the bench: {:?}", c.pods);
        for (i, pod) in c.pods.iter().enumerate() {
            let l = pod
                .launcher()
                .unwrap_or_else(|e| panic!("{manifest} {}: {e}", pod.name))
                .expect("a launcher");
            let expect = match manifest {
                "bench-lws.yaml" | "bench-disaggregatedset.yaml" => "LeaderWorkerSet",
                "bench-indexed-job.yaml" => "Indexed Job",
                _ => "Grove",
            };
            assert_eq!(l.name(), expect, "{manifest} {}", pod.name);
            if manifest != "bench-grove.yaml" && manifest != "bench-disaggregatedset.yaml" {
                assert_eq!(l.index(), i as u32, "{manifest} {}", pod.name);
            }
            let script = pod.command.join(" ");
            assert!(script.contains("kvx bench") || script.contains("kvx worker"), "{manifest}: {script}");
        }
    }
}

/// A directory with `kvx` (this build) and a `sleep` that returns at once, first on PATH.
fn bin_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    std::os::unix::fs::symlink(kvx_path(), dir.path().join("kvx")).expect("kvx link");
    let sleep = dir.path().join("sleep");
    std::fs::write(&sleep, "#!/bin/sh\nexit 0\n").expect("sleep stub");
    std::fs::set_permissions(&sleep, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    dir
}

/// Runs a bench manifest's pods across two namespaces; returns the bench's summary.
fn run_manifest(manifest: &str, hosts: &TwoHosts, work: &Path) -> Value {
    let c = cluster(manifest);
    let names: Vec<(String, String)> =
        c.bench_names.iter().map(|n| (n.clone(), hosts.d.addr.clone())).collect();
    hosts.hosts_file(&names).expect("hosts file");
    let bin = bin_dir();
    let path = format!("{}:{}", bin.path().display(), std::env::var("PATH").unwrap_or_default());
    let mut results = vec![];
    let mut procs: Vec<Spawned> = vec![];
    for pod in &c.pods {
        let side: &Side = if pod.host == Host::Prefill { &hosts.p } else { &hosts.d };
        let mut script = pod.command[2..].join(" ");
        assert_eq!(pod.command[..2], ["sh", "-c"], "{manifest} {}: sh -c SCRIPT", pod.name);
        for (mount, files) in &pod.mounts {
            let dir = work.join(format!("{}{}", pod.name, mount.replace('/', "_")));
            std::fs::create_dir_all(&dir).expect("mount dir");
            for (f, text) in files {
                std::fs::write(dir.join(f), text).expect("configmap file");
            }
            if mount == "/results" {
                results.push(dir.clone());
            }
            script = script.replace(mount.as_str(), &dir.display().to_string());
        }
        let mut cmd = TwoHosts::exec(side, "sh".as_ref());
        cmd.arg("-c").arg(&script).env("PATH", &path).env_remove("HOSTNAME");
        for (k, v) in pod.env(&side.addr) {
            cmd.env(k, v);
        }
        procs.push(Spawned::start(&format!("{manifest} pod {}", pod.name), cmd));
    }
    for p in &mut procs {
        let st = p.expect_exit(RUN_TIMEOUT);
        assert!(st.success(), "{} exited {st}; stderr:\n{}", p.name, p.stderr());
    }
    // The pod that ran the bench wrote one run; the others (an Indexed Job's pods share
    // the bench's template) wrote none.
    let runs: Vec<PathBuf> = results.iter().filter_map(|r| crate::procs::run_dir(r)).collect();
    assert_eq!(runs.len(), 1, "{manifest}: one run under {results:?}");
    let run = &runs[0];
    let text = std::fs::read_to_string(run.join("summary.json")).expect("summary.json");
    serde_json::from_str(&text).expect("summary JSON")
}

#[test]
fn bench_manifests_run_across_two_network_namespaces_with_their_pods_environment() {
    let _turn = exclusive();
    for manifest in BENCH_MANIFESTS {
        let hosts = match TwoHosts::create() {
            Ok(h) => h,
            Err(why) => {
                skip(
                    Part::Netns,
                    &format!("bench manifests across namespaces: cannot make namespaces: {why}"),
                );
                return;
            }
        };
        let work = tempfile::tempdir().expect("temp dir");
        let s = run_manifest(manifest, &hosts, work.path());
        let requests = n(&s, "requests_ok") + n(&s, "requests_failed");
        assert!(requests >= 1, "{manifest}: {s}");
        check_across(manifest, &s, requests);
        assert_eq!(s["scenario"]["p_tp"], 2, "{manifest}: {}", s["scenario"]);
        assert_eq!(s["scenario"]["d_tp"], 1, "{manifest}: {}", s["scenario"]);
        let launcher = &s["environment"]["launcher"];
        let expect = match manifest {
            "bench-lws.yaml" => serde_json::json!({"kind": "leader_worker_set", "worker_index": 0}),
            "bench-indexed-job.yaml" => serde_json::json!({"kind": "indexed_job", "completion_index": 0}),
            "bench-grove.yaml" => serde_json::json!({"kind": "grove", "pod_index": 0}),
            _ => serde_json::json!({"kind": "leader_worker_set", "worker_index": 0}),
        };
        for (k, v) in expect.as_object().expect("object") {
            assert_eq!(&launcher[k], v, "{manifest}: the report names the bench pod's launcher: {launcher}");
        }
    }
}

/// A worker with a partial or doubled launcher environment stops before connecting: exit 2
/// naming the variable(s); `kvx doctor` says the same, and names a launcher it recognises.
#[test]
fn missing_or_conflicting_launcher_variables_are_exit_2_naming_them() {
    let worker = |vars: &[(&str, &str)]| {
        let mut cmd = assert_cmd::Command::new(kvx_path());
        cmd.args(["worker", "--connect", "tcp://127.0.0.1:9", "--p-tp", "2"]).timeout(STEP_TIMEOUT);
        for v in kvx::vocab::launcher::ALL {
            cmd.env_remove(v);
        }
        cmd.envs(vars.iter().copied());
        let out = cmd.output().expect("kvx worker");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) = worker(&[("LWS_WORKER_INDEX", "1"), ("LWS_GROUP_SIZE", "4")]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("(change LWS_LEADER_ADDRESS)"), "{err}");
    let (code, err) = worker(&[
        ("JOB_COMPLETION_INDEX", "1"),
        ("LWS_WORKER_INDEX", "1"),
        ("LWS_GROUP_SIZE", "4"),
        ("LWS_LEADER_ADDRESS", "kvx-bench-0.kvx-bench.default"),
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("LWS_WORKER_INDEX or JOB_COMPLETION_INDEX"), "{err}");
    let (code, err) = worker(&[("GROVE_PCLQ_POD_INDEX", "0")]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("(change GROVE_PCLQ_NAME)"), "{err}");
    // Pod 0 of a group is the bench's, not a worker's.
    let (code, err) = worker(&[("JOB_COMPLETION_INDEX", "0")]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("(change JOB_COMPLETION_INDEX)"), "{err}");

    let doctor = |vars: &[(&str, &str)]| {
        let mut cmd = assert_cmd::Command::new(kvx_path());
        cmd.args(["doctor", "--no-self-test", "--format", "json"]).timeout(STEP_TIMEOUT);
        for v in kvx::vocab::launcher::ALL {
            cmd.env_remove(v);
        }
        cmd.envs(vars.iter().copied());
        let out = cmd.output().expect("kvx doctor");
        let report: Value = serde_json::from_slice(&out.stdout).expect("doctor JSON");
        let line =
            report["checks"].as_array().expect("checks").iter().find(|c| c["name"] == "launcher").cloned();
        (out.status.code(), line.expect("a launcher line"))
    };
    let (_, line) = doctor(&[("JOB_COMPLETION_INDEX", "2"), ("HOSTNAME", "kvx-bench-2")]);
    assert_eq!(line["verdict"], "ok", "{line}");
    assert_eq!(line["detail"], "Indexed Job, JOB_COMPLETION_INDEX=2, host kvx-bench-2", "{line}");
    let (code, line) =
        doctor(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("RANK", "1"), ("WORLD_SIZE", "2")]);
    assert_eq!(code, Some(2), "{line}");
    assert_eq!(line["verdict"], "fail", "{line}");
    assert!(line["detail"].as_str().is_some_and(|d| d.contains("SLURM_PROCID or RANK")), "{line}");
}

/// The schema directory: CRDs as their projects publish them, and Kubernetes' core schemas.
fn schema_dir() -> PathBuf {
    deploy_dir().join("schemas")
}

/// A CRD's schema for `version`, strict: every object that lists its properties refuses
/// others (a CRD's structural schema lets the API server drop unknown fields silently, so a
/// misspelled field would otherwise pass here and vanish there).
fn crd_schema(file: &str, version: &str) -> Value {
    fn strict(v: &mut Value) {
        match v {
            Value::Object(m) => {
                if m.contains_key("properties")
                    && !m.contains_key("additionalProperties")
                    && !m.contains_key("x-kubernetes-preserve-unknown-fields")
                {
                    m.insert("additionalProperties".into(), Value::Bool(false));
                }
                m.values_mut().for_each(strict);
            }
            Value::Array(a) => a.iter_mut().for_each(strict),
            _ => {}
        }
    }
    let crd = documents(&schema_dir().join(file)).remove(0);
    let v = crd["spec"]["versions"]
        .as_array()
        .expect("versions")
        .iter()
        .find(|v| v["name"] == version)
        .unwrap_or_else(|| panic!("{file} has no version {version}"));
    let mut schema = v["schema"]["openAPIV3Schema"].clone();
    strict(&mut schema);
    schema
}

/// A validator for one document of a manifest, by its apiVersion and kind.
fn validator_for(doc: &Value) -> jsonschema::Validator {
    let api = (doc["apiVersion"].as_str().unwrap_or(""), doc["kind"].as_str().unwrap_or(""));
    let core = |file: &str| {
        let dir = schema_dir().join("kubernetes-v1.33.0");
        let read = |f: &str| -> Value {
            serde_json::from_str(&std::fs::read_to_string(dir.join(f)).expect("schema file"))
                .expect("schema JSON")
        };
        let defs = jsonschema::Resource::from_contents(read("_definitions.json")).expect("definitions");
        jsonschema::options()
            .with_resource("https://kubernetes.io/api/_definitions.json", defs)
            .build(&read(file))
            .expect("core schema builds")
    };
    let crd = |file: &str, version: &str| {
        jsonschema::validator_for(&crd_schema(file, version)).expect("CRD schema builds")
    };
    match api {
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet") => {
            crd("leaderworkerset.x-k8s.io_leaderworkersets.yaml", "v1")
        }
        ("disaggregatedset.x-k8s.io/v1", "DisaggregatedSet") => {
            crd("disaggregatedset.x-k8s.io_disaggregatedsets.yaml", "v1")
        }
        ("grove.io/v1alpha1", "PodCliqueSet") => crd("grove.io_podcliquesets.yaml", "v1alpha1"),
        ("apps/v1", "Deployment") => core("deployment-apps-v1.json"),
        ("batch/v1", "Job") => core("job-batch-v1.json"),
        ("v1", "Service") => core("service-v1.json"),
        ("v1", "ConfigMap") => core("configmap-v1.json"),
        other => panic!("no schema committed for {other:?}"),
    }
}

fn schema_errors(doc: &Value) -> Vec<String> {
    validator_for(doc).iter_errors(doc).map(|e| format!("{e} at {}", e.instance_path)).collect()
}

/// Every manifest of `deploy/kubernetes/` validates against its schema, and a misspelled
/// field does not (the check can fail).
#[test]
fn every_manifest_validates_against_its_published_schema() {
    let mut manifests: Vec<PathBuf> = std::fs::read_dir(deploy_dir())
        .expect("deploy/kubernetes")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    manifests.sort();
    assert!(manifests.len() >= 5, "{manifests:?}");
    let mut kinds = std::collections::BTreeSet::new();
    for m in &manifests {
        for doc in documents(m) {
            let errors = schema_errors(&doc);
            assert!(errors.is_empty(), "{} {}: {errors:#?}", m.display(), doc["kind"]);
            kinds.insert(s(&doc["kind"]));
        }
    }
    let all =
        ["ConfigMap", "Deployment", "DisaggregatedSet", "Job", "LeaderWorkerSet", "PodCliqueSet", "Service"];
    assert_eq!(kinds.iter().map(String::as_str).collect::<Vec<_>>(), all);

    // Misspelled fields, in each kind of schema, are caught.
    let lws = kind(&documents(&deploy_dir().join("bench-lws.yaml")), "LeaderWorkerSet").clone();
    let mut bad = lws.clone();
    bad["spec"]["leaderWorkerTemplate"]["sise"] = 4.into();
    assert!(schema_errors(&bad).iter().any(|e| e.contains("sise")), "{:?}", schema_errors(&bad));
    let mut bad = lws;
    bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["comand"] = "x".into();
    assert!(!schema_errors(&bad).is_empty());
    let mut bad = kind(&documents(&deploy_dir().join("bench-indexed-job.yaml")), "Job").clone();
    bad["spec"]["completionMode"] = "Indexd".into();
    bad["spec"]["template"]["spec"]["subdomian"] = "kvx-bench".into();
    assert!(schema_errors(&bad).iter().any(|e| e.contains("subdomian")), "{:?}", schema_errors(&bad));
    let mut bad = kind(&documents(&deploy_dir().join("serve.yaml")), "Deployment").clone();
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/health".into();
    assert!(!schema_errors(&bad).is_empty());
    let mut bad = kind(&documents(&deploy_dir().join("bench-grove.yaml")), "PodCliqueSet").clone();
    bad["spec"]["template"]["cliques"][0]["spec"]["replica"] = 1.into();
    assert!(!schema_errors(&bad).is_empty());
}

/// The serving Deployments probe the health endpoints and are annotated for Prometheus on the
/// port their container serves /metrics on.
#[test]
fn serving_deployments_probe_health_and_are_annotated_for_prometheus() {
    let docs = documents(&deploy_dir().join("serve.yaml"));
    let deployments: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "Deployment").collect();
    assert_eq!(deployments.len(), 3);
    for d in deployments {
        let t = &d["spec"]["template"];
        let c = &t["spec"]["containers"][0];
        let a = &t["metadata"]["annotations"];
        assert_eq!(a["prometheus.io/scrape"], "true", "{d}");
        assert_eq!(a["prometheus.io/path"], "/metrics", "{d}");
        let port = c["ports"][0]["containerPort"].as_u64().expect("port").to_string();
        assert_eq!(a["prometheus.io/port"], port.as_str(), "{d}");
        assert!(c["args"].as_array().expect("args").iter().any(|x| x == &format!("--port={port}")), "{d}");
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/health", "{d}");
        // The proxy's /health is 503 while its backends are down: a liveness probe on it
        // would restart a proxy that is fine. Its own /healthcheck answers while it serves.
        let live = if c["args"][0] == "serve-proxy" { "/healthcheck" } else { "/health" };
        assert_eq!(c["livenessProbe"]["httpGet"]["path"], live, "{d}");
    }
}
