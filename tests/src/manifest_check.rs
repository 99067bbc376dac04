//! `kubernetes-validate` (`PyPI`), which checks manifests against the
//! Kubernetes API's `OpenAPI` schemas offline. `cargo xtask setup` installs
//! this pinned version into its own virtual environment, so neither the
//! system's Python packages nor the version a test sees can drift.

/// The pinned release (schemas up to Kubernetes 1.37).
pub const KUBERNETES_VALIDATE_VERSION: &str = "1.37.0";

/// Where setup puts the virtual environment, named for the version so that
/// a new pin installs afresh.
pub const KUBERNETES_VALIDATE_VENV: &str = "/opt/kubernetes-validate-1.37.0";

/// The command inside it.
pub const KUBERNETES_VALIDATE: &str = "/opt/kubernetes-validate-1.37.0/bin/kubernetes-validate";
