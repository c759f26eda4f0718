//! Tables of the docs generated from the crate's own tables, and checked in:
//!
//! - docs/metrics.md's metric table, from `gpu_arena::stats::STAT_FIELDS` (alloc/src/stats.rs);
//! - docs/configuration.md's Keys table, from `gpu_arena::config::KEY_TABLE`
//!   (alloc/src/config.rs).
//!
//! Each generated table sits between a `<!-- generated ... -->` line and
//! `<!-- end of generated table -->`; the prose around it is written by hand. A test fails
//! when the checked-in table differs from what the crate's table generates; regenerate with
//! `GPU_ARENA_BLESS=1 cargo test -p gpu-arena --test generated_docs`.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use gpu_arena::config::KEY_TABLE;
use gpu_arena::stats::STAT_FIELDS;

const END: &str = "<!-- end of generated table -->";

fn repo_path(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
}

/// Whether `GPU_ARENA_BLESS` asks to rewrite the generated tables.
fn blessing() -> bool {
    std::env::var("GPU_ARENA_BLESS").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// A table cell: `|` would end it.
fn cell(text: &str) -> &str {
    assert!(
        !text.contains('|') && !text.contains('\n'),
        "{text:?} in a table cell"
    );
    text
}

/// The region of `doc` (a path in the repository) after the line `begin` and before
/// [`END`] is `table`, or (blessing) becomes it.
fn check_region(doc: &str, begin: &str, table: &str) {
    let path = repo_path(doc);
    let text = std::fs::read_to_string(&path).unwrap();
    let start = text
        .find(&format!("{begin}\n"))
        .unwrap_or_else(|| panic!("{doc} lacks the line `{begin}`"))
        + begin.len()
        + 1;
    let end = start
        + text[start..]
            .find(END)
            .unwrap_or_else(|| panic!("{doc} lacks `{END}` after `{begin}`"));
    if &text[start..end] == table {
        return;
    }
    if blessing() {
        let new = format!("{}{table}{}", &text[..start], &text[end..]);
        std::fs::write(&path, new).unwrap();
        eprintln!("GPU_ARENA_BLESS: rewrote the generated table of {doc}");
        return;
    }
    let (have, want): (Vec<&str>, Vec<&str>) =
        (text[start..end].lines().collect(), table.lines().collect());
    let first = (0..have.len().max(want.len()))
        .find(|&i| have.get(i) != want.get(i))
        .unwrap_or(0);
    panic!(
        "{doc}'s generated table is stale (line {} of the table):\n  generated:  {}\n  checked in: {}\n\
         Regenerate it with:\n  GPU_ARENA_BLESS=1 cargo test -p gpu-arena --test generated_docs",
        first + 1,
        want.get(first).unwrap_or(&"<end>"),
        have.get(first).unwrap_or(&"<end>"),
    );
}

/// docs/metrics.md's table: one row per `PoolStats` field, in the struct's order.
fn metrics_table() -> String {
    let mut out =
        String::from("| name | type | `PoolStats` field | Rust | help |\n|---|---|---|---|---|\n");
    for f in STAT_FIELDS {
        out += &format!(
            "| `{}` | {} | `{}` | {} | {} |\n",
            cell(f.metric),
            f.kind.as_str(),
            cell(f.name),
            if f.facade { "yes" } else { "no" },
            cell(f.help)
        );
    }
    out
}

#[test]
fn metrics_doc_table_is_generated_from_stat_fields() {
    check_region(
        "docs/metrics.md",
        "<!-- generated from STAT_FIELDS (alloc/src/stats.rs) by alloc/tests/generated_docs.rs -->",
        &metrics_table(),
    );
}

/// docs/configuration.md's Keys table: one row per key, in the table's order.
fn keys_table() -> String {
    let mut out = String::from("| key | values | default | meaning |\n|---|---|---|---|\n");
    for k in &KEY_TABLE {
        out += &format!(
            "| `{}` | {} | {} | {} |\n",
            cell(k.name),
            cell(k.values),
            cell(k.default),
            cell(k.help)
        );
    }
    out
}

#[test]
fn configuration_doc_table_is_generated_from_key_table() {
    check_region(
        "docs/configuration.md",
        "<!-- generated from KEY_TABLE (alloc/src/config.rs) by alloc/tests/generated_docs.rs -->",
        &keys_table(),
    );
}
