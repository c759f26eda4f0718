//! The configuration keys have one home, `gpu_arena::config::KEYS` (alloc/src/config.rs, whose
//! own tests check it against `Config::apply` and the module's table). The places that list
//! them for users must list exactly those: docs/configuration.md's Keys table, python/README.md's
//! "Configuration keys" paragraph and the docstring of Python's `gpu_arena.configure`.

use std::collections::BTreeSet;
use std::path::Path;

use gpu_arena::config::KEYS;

fn repo_file(path: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn keys() -> BTreeSet<String> {
    KEYS.iter().map(|k| k.to_string()).collect()
}

/// The `backticked` words of `text` that look like a key (lower case, digits, `_`).
fn backticked_keys(text: &str) -> BTreeSet<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|w| {
            !w.is_empty()
                && w.starts_with(|c: char| c.is_ascii_lowercase())
                && w.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        })
        .map(str::to_string)
        .collect()
}

/// The text of `doc`'s section `heading` (from the heading to the next heading of its level).
fn section<'a>(doc: &'a str, heading: &str) -> &'a str {
    let start = doc
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no `{heading}` section"))
        + 1;
    let level = heading.split(' ').next().unwrap_or("##");
    let rest = &doc[start + heading.len()..];
    let end = rest.find(&format!("\n{level} ")).unwrap_or(rest.len());
    &rest[..end]
}

#[test]
fn configuration_doc_table_lists_every_key() {
    let doc = repo_file("docs/configuration.md");
    let table = section(&doc, "## Keys")
        .lines()
        .filter(|l| l.starts_with("| `"))
        // The first cell: one key, or several (`sim_devices`, `sim_capacity`, ...).
        .flat_map(|l| backticked_keys(l.split('|').nth(1).unwrap_or("")))
        .collect::<BTreeSet<_>>();
    assert_eq!(
        table,
        keys(),
        "docs/configuration.md's Keys table against config.rs's KEYS"
    );
}

#[test]
fn python_readme_lists_every_key() {
    let readme = repo_file("python/README.md");
    let start = readme
        .find("Configuration keys")
        .expect("python/README.md has a `Configuration keys` paragraph");
    let paragraph = &readme[start..];
    let paragraph = &paragraph[..paragraph.find("\n\n").unwrap_or(paragraph.len())];
    // The paragraph's backticked words beyond the keys are values (`0.9`, `90%`), which
    // backticked_keys leaves out.
    assert_eq!(
        backticked_keys(paragraph),
        keys(),
        "python/README.md's Configuration keys paragraph against config.rs's KEYS"
    );
}

#[test]
fn python_configure_docstring_lists_every_key() {
    let source = repo_file("python/gpu_arena/runtime.py");
    let def = source
        .find("def configure(")
        .expect("runtime.py defines configure");
    let doc = &source[def..];
    let doc = &doc[doc.find("\"\"\"").expect("configure has a docstring") + 3..];
    let doc = &doc[..doc.find("\"\"\"").expect("the docstring ends")];
    let list = &doc[doc
        .find("(keys: ")
        .expect("the docstring lists `(keys: ...)`")
        + 7..];
    let list = &list[..list
        .find([')', ';'])
        .expect("the key list ends with `)` or `;`")];
    let listed: BTreeSet<String> = list
        .split(',')
        .map(|k| k.split_whitespace().collect::<String>())
        .collect();
    assert_eq!(
        listed,
        keys(),
        "gpu_arena.configure's docstring against config.rs's KEYS"
    );
}
