//! Every crate's top-level modules import one another without a circle: a module may use the
//! ones below it, never one that (through others) uses it back. A newcomer can then read a
//! crate bottom-up, and a change to a module cannot break the ones it sits under.
//!
//! A module's imports are the `crate::name` paths written in its files (doc comments and
//! comments aside); a module's files are `name.rs` and everything under `name/`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The crates' source folders, from the workspace root.
const CRATES: &[&str] = &[
    "src",
    "sys/src",
    "platform/src",
    "compress/src",
    "swap/src",
    "hsdp/src",
    "python/src",
    "cli/src",
    "conformance/src",
];

type Graph = BTreeMap<String, BTreeSet<String>>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module names a line imports with `crate::name` or `crate::{a, b::c}`.
fn imported(line: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut names = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Only the first segment of each path in the group names a module of the crate.
            let mut depth = 0;
            let mut start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if start && !c.is_whitespace() => {
                        names.push(ident(&group[i..]));
                        start = false;
                    }
                    _ => {}
                }
            }
        } else {
            names.push(ident(rest));
        }
    }
    names
}

fn graph(src: &Path) -> Graph {
    let mut tops = BTreeSet::new();
    for entry in fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        if path.is_dir()
            || (path.extension().is_some_and(|e| e == "rs") && stem != "lib" && stem != "main")
        {
            tops.insert(stem);
        }
    }
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut g: Graph = tops.iter().map(|t| (t.clone(), BTreeSet::new())).collect();
    for file in files {
        let rel = file.strip_prefix(src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let top = first.trim_end_matches(".rs").to_owned();
        if !tops.contains(&top) {
            continue;
        }
        for line in fs::read_to_string(&file).unwrap().lines() {
            if line.trim_start().starts_with("//") {
                continue;
            }
            for name in imported(line) {
                if name != top && tops.contains(&name) {
                    g.get_mut(&top).unwrap().insert(name);
                }
            }
        }
    }
    g
}

/// One circle of `g`, if it has any, as the modules along it.
fn circle(g: &Graph) -> Option<Vec<String>> {
    fn visit(
        g: &Graph,
        at: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|m| m == at) {
            let mut c = path[i..].to_vec();
            c.push(at.to_owned());
            return Some(c);
        }
        if done.contains(at) {
            return None;
        }
        path.push(at.to_owned());
        for next in &g[at] {
            if let Some(c) = visit(g, next, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(at.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    g.keys()
        .find_map(|m| visit(g, m, &mut Vec::new(), &mut done))
}

#[test]
fn no_crate_has_a_circle_among_its_modules() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let circles: Vec<String> = CRATES
        .iter()
        .filter_map(|c| circle(&graph(&root.join(c))).map(|m| format!("{c}: {}", m.join(" -> "))))
        .collect();
    assert!(
        circles.is_empty(),
        "module circles:\n{}",
        circles.join("\n")
    );
}

#[test]
fn the_check_sees_a_circle_and_grouped_imports() {
    assert_eq!(
        imported("use crate::{a::{B, C}, d, e::F};"),
        ["a", "d", "e"]
    );
    assert_eq!(
        imported("let x = crate::wait::f(crate::error::g());"),
        ["wait", "error"]
    );
    let g: Graph = [("a", &["b"][..]), ("b", &["c"]), ("c", &["a"]), ("d", &[])]
        .iter()
        .map(|(m, to)| (m.to_string(), to.iter().map(|t| t.to_string()).collect()))
        .collect();
    assert_eq!(circle(&g).unwrap(), ["a", "b", "c", "a"]);
    let mut acyclic = g.clone();
    acyclic.get_mut("c").unwrap().clear();
    assert_eq!(circle(&acyclic), None);
}
