//! The configuration keys have one home, `gpu_arena::config::KEY_TABLE` (alloc/src/config.rs,
//! whose own tests check it against `Config::apply` and `Config::default`);
//! docs/configuration.md's Keys table is generated from it (`generated_docs.rs`) and the
//! library serves it (`gpu_arena_config_keys`). The Python package's words for users point there
//! instead of keeping a list of their own: python/README.md's "Configuration keys" paragraph
//! and the docstring of `gpu_arena.configure` name `config_keys()`, and neither lists more
//! than a few keys (a list would be a copy to keep in step).

use std::path::Path;

use gpu_arena::config::KEYS;

fn repo_file(path: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// How many keys `text` names in backticks (`` `arena_size` ``) or, in a docstring, bare.
fn keys_named(text: &str) -> usize {
    KEYS.iter()
        .filter(|k| {
            text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .any(|w| w == **k)
        })
        .count()
}

#[test]
fn python_readme_points_to_the_served_table() {
    let readme = repo_file("python/README.md");
    let start = readme
        .find("Configuration keys")
        .expect("python/README.md has a `Configuration keys` paragraph");
    let paragraph = &readme[start..];
    let paragraph = &paragraph[..paragraph.find("\n\n").unwrap_or(paragraph.len())];
    assert!(paragraph.contains("gpu_arena.config_keys()"), "{paragraph}");
    assert!(
        keys_named(paragraph) <= 4,
        "python/README.md's Configuration keys paragraph lists the keys again: {paragraph}"
    );
}

#[test]
fn python_configure_docstring_points_to_the_served_table() {
    let source = repo_file("python/gpu_arena/runtime.py");
    let def = source
        .find("def configure(")
        .expect("runtime.py defines configure");
    let doc = &source[def..];
    let doc = &doc[doc.find("\"\"\"").expect("configure has a docstring") + 3..];
    let doc = &doc[..doc.find("\"\"\"").expect("the docstring ends")];
    assert!(doc.contains(":func:`config_keys`"), "{doc}");
    assert!(
        keys_named(doc) <= 2,
        "gpu_arena.configure's docstring lists the keys again: {doc}"
    );
}
