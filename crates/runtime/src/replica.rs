//! This process's name in records and in shared state.

/// A name for this replica: the pod name under Kubernetes (`HOSTNAME`, or `SLUICE_REPLICA_ID`
/// to choose one), then the pid, so two processes of one pod never share it.
pub fn replica_id() -> String {
    std::env::var("SLUICE_REPLICA_ID")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "sluice".into())
        + &format!("-{}", std::process::id())
}
