//! Built without the `cuda` feature: the types exist (so callers need no `cfg`) but cannot
//! be constructed; every constructor says how to get CUDA support. The `cuda` build's are
//! `ipc.rs` (export, PeerMapping) and `copier.rs` (BatchCopier).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use super::error::CudaBatchError;
use super::grid::GridBatch;
use super::pack::{CopyBatch, Span};
use super::path::{BatchCopy, BatchPath, BatchStats};
use crate::layouts::read_plan::Pair;
use crate::transfer::cuda::{CudaBuffer, CudaDevice, CudaError};
use crate::transfer::handshake::meta::CudaIpcExport;

pub fn export(_buf: &CudaBuffer) -> Result<CudaIpcExport, CudaBatchError> {
    Err(CudaError::NotBuilt.into())
}

/// Never constructed without the `cuda` feature.
#[derive(Debug)]
pub struct PeerMapping {
    never: Infallible,
}

impl PeerMapping {
    pub fn open(
        _dev: &Arc<CudaDevice>,
        _peer: &str,
        _export: Option<&CudaIpcExport>,
    ) -> Result<Arc<PeerMapping>, CudaBatchError> {
        Err(CudaError::NotBuilt.into())
    }
    pub fn span(&self) -> Span {
        match self.never {}
    }
}

/// Never constructed without the `cuda` feature.
#[derive(Debug)]
pub struct BatchCopier {
    never: Infallible,
}

impl BatchCopier {
    pub fn new(_dev: &Arc<CudaDevice>, _copy: BatchCopy) -> Result<BatchCopier, CudaBatchError> {
        Err(CudaError::NotBuilt.into())
    }
    pub fn path(&self) -> BatchPath {
        match self.never {}
    }
    pub fn under_mps(&self) -> bool {
        match self.never {}
    }
    pub fn copy(
        &mut self,
        _local: &mut CudaBuffer,
        _peer: &Arc<PeerMapping>,
        _batch: &mut CopyBatch,
        _timeout: Duration,
    ) -> Result<BatchStats, CudaBatchError> {
        match self.never {}
    }
    pub fn enqueue(
        &mut self,
        _local: &mut CudaBuffer,
        _peers: &[Arc<PeerMapping>],
        _parts: &mut [CopyBatch],
        _timeout: Duration,
    ) -> Result<BatchStats, CudaBatchError> {
        match self.never {}
    }
    pub fn enqueue_pairs(
        &mut self,
        _local: &mut CudaBuffer,
        _peers: &[Arc<PeerMapping>],
        _jobs: &[&[Pair]],
        _timeout: Duration,
    ) -> Result<BatchStats, (Option<usize>, CudaBatchError)> {
        match self.never {}
    }
    pub fn enqueue_grid(
        &mut self,
        _local: &mut CudaBuffer,
        _peers: &[Arc<PeerMapping>],
        _grid: &GridBatch,
        _timeout: Duration,
    ) -> Result<BatchStats, CudaBatchError> {
        match self.never {}
    }
    pub fn finish(&mut self, _timeout: Duration) -> Result<u64, CudaBatchError> {
        match self.never {}
    }
}
