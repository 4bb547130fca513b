mod ucx;
mod ucx_common;
mod ucx_layout;
