//! Helper threads of the model test: a step may run on one of them instead of the test's
//! own thread, so that blocks are allocated and freed on different threads (a free looks
//! through another thread's cache), each thread's cache holds its own blocks when a miss
//! flushes, and a thread that exits leaves its cache behind for the pool to take back.

use std::sync::mpsc;
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send>;

/// A thread that runs the closures it is given, one at a time, until it is retired.
pub(crate) struct Helper {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Helper {
    pub(crate) fn start() -> Helper {
        let (jobs, inbox) = mpsc::channel::<Job>();
        let thread = std::thread::spawn(move || {
            for job in inbox {
                job();
            }
        });
        Helper {
            jobs: Some(jobs),
            thread: Some(thread),
        }
    }

    /// Run `f` on this thread and wait for its result (a panic there fails the test here).
    pub(crate) fn run<R: Send + 'static>(&self, f: impl FnOnce() -> R + Send + 'static) -> R {
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(f());
        });
        self.jobs
            .as_ref()
            .expect("a retired helper")
            .send(job)
            .expect("the helper thread is gone");
        rx.recv().expect("the helper thread panicked")
    }

    /// End the thread (its thread-locals, thread caches included, go with it) and wait.
    pub(crate) fn retire(&mut self) {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            t.join().expect("the helper thread panicked");
        }
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
