//! How big things are, as pure functions of sizes (no pool state): the block serving a
//! request, the size class of a block and the arena it comes from, and how much a growing
//! arena maps.

pub(super) mod blocks;
pub(super) mod classes;
pub(super) mod growth_steps;
