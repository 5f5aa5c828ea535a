//! The handle of a running peer page service: a cancellation token plus a tracker of
//! every task it spawned, so shutdown can wait until all of them are gone.

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A running server (from [`crate::Transport::serve`]). Dropping it stops the server
/// without waiting; [`Server::shutdown`] stops it and waits for every task.
#[derive(Debug)]
pub struct Server {
    cancel: CancellationToken,
    tasks: TaskTracker,
}

impl Server {
    pub(crate) fn new(cancel: CancellationToken, tasks: TaskTracker) -> Self {
        Server { cancel, tasks }
    }

    /// Stops accepting, closes the connections it serves (requests in progress are
    /// abandoned; their peers see the connection close), and waits for every task.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
