//! kvx's hand-written `#[repr(C)]` UCX structs against the C headers: a small C program,
//! compiled with `cc` at test time against each UCX's headers found on this host, prints
//! `sizeof`/`offsetof`, and every value must match `kvx::transfer::ucx::sys`.

use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

use kvx::transfer::ucx::sys::*;

use crate::ucx_common::{Part, project_root, skip};

/// (C type, C field, Rust offset); a field of "" stands for `sizeof`.
fn rust_layout() -> Vec<(&'static str, &'static str, usize)> {
    macro_rules! fields {
        ($out:ident, $cty:literal, $rty:ty, [$($cf:literal => $rf:ident),* $(,)?]) => {
            $out.push(($cty, "", size_of::<$rty>()));
            $( $out.push(($cty, $cf, offset_of!($rty, $rf))); )*
        };
    }
    let mut v = Vec::new();
    fields!(v, "ucp_params_t", UcpParams, [
        "field_mask" => field_mask, "features" => features, "request_size" => request_size,
        "request_init" => request_init, "request_cleanup" => request_cleanup,
        "tag_sender_mask" => tag_sender_mask, "mt_workers_shared" => mt_workers_shared,
        "estimated_num_eps" => estimated_num_eps, "estimated_num_ppn" => estimated_num_ppn, "name" => name,
    ]);
    fields!(v, "ucp_worker_params_t", UcpWorkerParams, [
        "field_mask" => field_mask, "thread_mode" => thread_mode, "cpu_mask" => cpu_mask, "events" => events,
        "user_data" => user_data, "event_fd" => event_fd, "flags" => flags, "name" => name,
        "am_alignment" => am_alignment, "client_id" => client_id,
    ]);
    fields!(v, "ucp_ep_params_t", UcpEpParams, [
        "field_mask" => field_mask, "address" => address, "err_mode" => err_mode, "err_handler" => err_handler,
        "user_data" => user_data, "flags" => flags, "sockaddr" => sockaddr, "conn_request" => conn_request,
        "name" => name, "local_sockaddr" => local_sockaddr,
    ]);
    fields!(v, "ucp_mem_map_params_t", UcpMemMapParams, [
        "field_mask" => field_mask, "address" => address, "length" => length, "flags" => flags, "prot" => prot,
        "memory_type" => memory_type,
    ]);
    fields!(v, "ucp_mem_attr_t", UcpMemAttr, [
        "field_mask" => field_mask, "address" => address, "length" => length, "mem_type" => mem_type,
    ]);
    fields!(v, "ucp_context_attr_t", UcpContextAttr, [
        "field_mask" => field_mask, "request_size" => request_size, "thread_mode" => thread_mode,
        "memory_types" => memory_types, "name" => name,
    ]);
    fields!(v, "ucp_request_param_t", UcpRequestParam, [
        "op_attr_mask" => op_attr_mask, "flags" => flags, "request" => request, "cb" => cb, "datatype" => datatype,
        "user_data" => user_data, "reply_buffer" => reply_buffer, "memory_type" => memory_type,
        "recv_info" => recv_info, "memh" => memh,
    ]);
    fields!(v, "ucp_err_handler_t", UcpErrHandler, ["cb" => cb, "arg" => arg]);
    fields!(v, "ucp_am_handler_param_t", UcpAmHandlerParam, [
        "field_mask" => field_mask, "id" => id, "flags" => flags, "cb" => cb, "arg" => arg,
    ]);
    fields!(v, "ucp_am_recv_param_t", UcpAmRecvParam, ["recv_attr" => recv_attr, "reply_ep" => reply_ep]);
    fields!(v, "ucs_sock_addr_t", UcsSockAddr, ["addr" => addr, "addrlen" => addrlen]);
    v.push(("ucs_cpu_set_t", "", size_of::<UcsCpuSet>()));
    v.push(("ucs_status_t", "", size_of::<UcsStatus>()));
    v
}

/// Constants kvx declares, checked against the header's enumerators.
fn rust_constants() -> Vec<(&'static str, i64)> {
    vec![
        ("UCP_PARAM_FIELD_FEATURES", UCP_PARAM_FIELD_FEATURES as i64),
        ("UCP_PARAM_FIELD_MT_WORKERS_SHARED", UCP_PARAM_FIELD_MT_WORKERS_SHARED as i64),
        ("UCP_FEATURE_RMA", UCP_FEATURE_RMA as i64),
        ("UCP_FEATURE_WAKEUP", UCP_FEATURE_WAKEUP as i64),
        ("UCP_FEATURE_AM", UCP_FEATURE_AM as i64),
        ("UCP_WORKER_PARAM_FIELD_THREAD_MODE", UCP_WORKER_PARAM_FIELD_THREAD_MODE as i64),
        ("UCS_THREAD_MODE_SINGLE", UCS_THREAD_MODE_SINGLE as i64),
        ("UCP_EP_PARAM_FIELD_REMOTE_ADDRESS", UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as i64),
        ("UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE", UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE as i64),
        ("UCP_EP_PARAM_FIELD_ERR_HANDLER", UCP_EP_PARAM_FIELD_ERR_HANDLER as i64),
        ("UCP_ERR_HANDLING_MODE_NONE", UCP_ERR_HANDLING_MODE_NONE as i64),
        ("UCP_ERR_HANDLING_MODE_PEER", UCP_ERR_HANDLING_MODE_PEER as i64),
        ("UCP_EP_CLOSE_FLAG_FORCE", UCP_EP_CLOSE_FLAG_FORCE as i64),
        ("UCP_MEM_MAP_PARAM_FIELD_ADDRESS", UCP_MEM_MAP_PARAM_FIELD_ADDRESS as i64),
        ("UCP_MEM_MAP_PARAM_FIELD_LENGTH", UCP_MEM_MAP_PARAM_FIELD_LENGTH as i64),
        ("UCP_MEM_MAP_PARAM_FIELD_FLAGS", UCP_MEM_MAP_PARAM_FIELD_FLAGS as i64),
        ("UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE", UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE as i64),
        ("UCP_MEM_MAP_ALLOCATE", UCP_MEM_MAP_ALLOCATE as i64),
        ("UCP_MEM_ATTR_FIELD_ADDRESS", UCP_MEM_ATTR_FIELD_ADDRESS as i64),
        ("UCP_MEM_ATTR_FIELD_LENGTH", UCP_MEM_ATTR_FIELD_LENGTH as i64),
        ("UCP_ATTR_FIELD_MEMORY_TYPES", UCP_ATTR_FIELD_MEMORY_TYPES as i64),
        ("UCP_OP_ATTR_FIELD_CALLBACK", UCP_OP_ATTR_FIELD_CALLBACK as i64),
        ("UCP_OP_ATTR_FIELD_USER_DATA", UCP_OP_ATTR_FIELD_USER_DATA as i64),
        ("UCP_OP_ATTR_FIELD_FLAGS", UCP_OP_ATTR_FIELD_FLAGS as i64),
        ("UCP_OP_ATTR_FIELD_MEMH", UCP_OP_ATTR_FIELD_MEMH as i64),
        ("UCS_MEMORY_TYPE_HOST", UCS_MEMORY_TYPE_HOST as i64),
        ("UCS_MEMORY_TYPE_CUDA", UCS_MEMORY_TYPE_CUDA as i64),
        ("UCP_AM_HANDLER_PARAM_FIELD_ID", UCP_AM_HANDLER_PARAM_FIELD_ID as i64),
        ("UCP_AM_HANDLER_PARAM_FIELD_FLAGS", UCP_AM_HANDLER_PARAM_FIELD_FLAGS as i64),
        ("UCP_AM_HANDLER_PARAM_FIELD_CB", UCP_AM_HANDLER_PARAM_FIELD_CB as i64),
        ("UCP_AM_HANDLER_PARAM_FIELD_ARG", UCP_AM_HANDLER_PARAM_FIELD_ARG as i64),
        ("UCP_AM_FLAG_WHOLE_MSG", UCP_AM_FLAG_WHOLE_MSG as i64),
        ("UCP_AM_SEND_FLAG_EAGER", UCP_AM_SEND_FLAG_EAGER as i64),
        ("UCP_AM_RECV_ATTR_FIELD_REPLY_EP", UCP_AM_RECV_ATTR_FIELD_REPLY_EP as i64),
        ("UCP_AM_RECV_ATTR_FLAG_DATA", UCP_AM_RECV_ATTR_FLAG_DATA as i64),
        ("UCP_AM_RECV_ATTR_FLAG_RNDV", UCP_AM_RECV_ATTR_FLAG_RNDV as i64),
        ("UCS_OK", UCS_OK as i64),
        ("UCS_INPROGRESS", UCS_INPROGRESS as i64),
        ("UCS_ERR_BUSY", UCS_ERR_BUSY as i64),
        ("UCS_ERR_CANCELED", UCS_ERR_CANCELED as i64),
        ("UCS_ERR_TIMED_OUT", UCS_ERR_TIMED_OUT as i64),
        ("UCS_ERR_NO_RESOURCE", UCS_ERR_NO_RESOURCE as i64),
        ("UCS_ERR_UNSUPPORTED", UCS_ERR_UNSUPPORTED as i64),
        ("UCS_ERR_LAST", UCS_ERR_LAST as i64),
    ]
}

fn c_probe_source() -> String {
    let mut s =
        String::from("#include <stdio.h>\n#include <stddef.h>\n#include <ucp/api/ucp.h>\nint main(void) {\n");
    for (cty, field, _) in rust_layout() {
        if field.is_empty() {
            s.push_str(&format!("  printf(\"{cty} sizeof %zu\\n\", sizeof({cty}));\n"));
        } else {
            s.push_str(&format!("  printf(\"{cty} {field} %zu\\n\", offsetof({cty}, {field}));\n"));
        }
    }
    for (name, _) in rust_constants() {
        s.push_str(&format!("  printf(\"const {name} %lld\\n\", (long long){name});\n"));
    }
    s.push_str("  return 0;\n}\n");
    s
}

/// Compiles and runs the probe against the headers under `include`; returns its lines.
fn run_probe(include: &Path) -> Vec<String> {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path().join("probe.c");
    let exe = dir.path().join("probe");
    std::fs::write(&src, c_probe_source()).expect("write probe");
    let out = Command::new("cc")
        .arg("-I")
        .arg(include)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("run cc (install build-essential)");
    assert!(
        out.status.success(),
        "cc failed against {}:\n{}",
        include.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(&exe).output().expect("run probe");
    assert!(out.status.success());
    String::from_utf8(out.stdout).expect("utf8").lines().map(str::to_owned).collect()
}

fn check_against(include: &Path, exact_sizes: bool) {
    let lines = run_probe(include);
    let value = |key: &str| -> i64 {
        lines
            .iter()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("probe printed no {key}"))
    };
    for (cty, field, rust) in rust_layout() {
        if field.is_empty() {
            let c = value(&format!("{cty} sizeof")) as usize;
            if exact_sizes {
                assert_eq!(rust, c, "sizeof({cty}) in {}", include.display());
            } else {
                // Newer headers may append fields; UCX reads only what field_mask names.
                assert!(rust <= c, "sizeof({cty}): kvx {rust} > C {c} in {}", include.display());
            }
        } else {
            assert_eq!(
                rust as i64,
                value(&format!("{cty} {field}")),
                "offsetof({cty}, {field}) in {}",
                include.display()
            );
        }
    }
    for (name, rust) in rust_constants() {
        assert_eq!(rust, value(&format!("const {name}")), "{name} in {}", include.display());
    }
}

#[test]
fn structs_match_debian_ucx_headers_exactly() {
    let include = PathBuf::from("/usr/include");
    if !include.join("ucp/api/ucp.h").is_file() {
        skip(
            Part::SystemUcx,
            "Debian's UCX headers (/usr/include/ucp/api/ucp.h) are not installed: apt-get install libucx-dev",
        );
        return;
    }
    check_against(&include, true);
}

#[test]
fn structs_match_project_ucx_headers() {
    let include = project_root().join(".ucx/libucx/include");
    if !include.join("ucp/api/ucp.h").is_file() {
        skip(Part::Ucx, "the project's UCX (.ucx/) is not installed: run scripts/setup-ucx.sh");
        return;
    }
    check_against(&include, false);
}
