//! What the code under test logged, captured for assertions and failure
//! messages: the errors that name a skipped object, say, or the retry a
//! fault should cause.

use std::{
    io,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use tracing::Subscriber;

/// A shared buffer of log lines, filled through [`Logs::subscriber`].
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    /// A subscriber writing INFO and above, without colours, into this
    /// buffer: attach it to the task under test
    /// (`tracing::instrument::WithSubscriber::with_subscriber`), so that
    /// tests running in parallel keep their logs apart.
    pub fn subscriber(&self) -> impl Subscriber + Send + Sync + 'static {
        let sink = self.clone();
        tracing_subscriber::fmt()
            .with_writer(move || Writer(sink.clone()))
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish()
    }

    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.buffer()).into_owned()
    }

    /// Waits until the log holds `needle`; panics with the log after
    /// `within`.
    pub async fn wait_for(&self, needle: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.text().contains(needle) {
            assert!(
                Instant::now() <= deadline,
                "nothing logged {needle:?} within {within:?}; the log:\n{}",
                self.text()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn buffer(&self) -> MutexGuard<'_, Vec<u8>> {
        // Appends only: a panic elsewhere leaves whole lines behind.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The `tracing` writer behind [`Logs::subscriber`].
struct Writer(Logs);

impl io::Write for Writer {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.buffer().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
