//! Steps a test runs inside the sim's driver calls ([`SimBackend::run_during_next`]): another
//! thread's work placed between the start of a call and its end, so that a race the pool must
//! survive happens every time instead of once in a long run.

use parking_lot::Mutex;

use super::{SimBackend, SimCall};

type Step = Box<dyn FnOnce() + Send>;

/// The steps waiting for their call, in the order they were given.
#[derive(Default)]
pub(super) struct Steps(Mutex<Vec<(SimCall, Step)>>);

impl std::fmt::Debug for Steps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let calls: Vec<SimCall> = self.0.lock().iter().map(|(c, _)| *c).collect();
        f.debug_tuple("Steps").field(&calls).finish()
    }
}

impl SimBackend {
    /// Run `step` once, at the start of the next call of kind `call` (only
    /// [`SimCall::Synchronize`] runs steps), before the call does anything and with no lock
    /// of the sim held: `step` may call the pool, which calls the sim.
    pub fn run_during_next(&self, call: SimCall, step: impl FnOnce() + Send + 'static) {
        self.steps.0.lock().push((call, Box::new(step)));
    }

    /// Run the first step waiting for `call`, if any.
    pub(super) fn run_step(&self, call: SimCall) {
        let step = {
            let mut steps = self.steps.0.lock();
            let i = steps.iter().position(|(c, _)| *c == call);
            i.map(|i| steps.remove(i).1)
        };
        if let Some(step) = step {
            step();
        }
    }
}
