//! NIXL's agent metadata blob (`nixl_agent.get_agent_metadata()`), decoded without NIXL.
#![forbid(unsafe_code)]
