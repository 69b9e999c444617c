//! Layering of a crate's modules: files import only what lies below them.
//!
//! A crate lists its top-level modules bottom to top ([`Layers::order`]), and each folder
//! module its child files bottom to top ([`Layers::folders`]). [`Layers::scan`] reads every
//! `crate::`, `super::` and `self::` path in the crate's sources (grouped `use a::{b, c::{d}}`
//! forms too; comments, string literals and `#[cfg(test)]` modules left out), resolves it to the
//! file that defines it, and reports what runs back up:
//!
//! - a path into a module listed after the importer's (at the level where the two part: the
//!   top-level order, or the order of the folder they share);
//! - a path to an item of a facade above the importer (the crate root above every module, a
//!   folder's `mod.rs` above its own child files): `crate::Outcome` from a module, or
//!   `super::connect` from a child of `broker/mod.rs`. A facade re-exports downward for those
//!   outside it; its children name the defining sibling instead (`super::sibling::Item`);
//! - a pair the order allows but the architecture does not ([`Layers::forbidden`]).
//!
//! Nodes are files. [`Report::circles`] lists import cycles between files: each set of files
//! that reach each other (a facade's own edges down to its children left out, since a facade
//! declares them all), and each file that imports its own facade.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

/// A crate's layers: what [`Layers::scan`] checks its sources against.
#[derive(Clone, Debug)]
pub struct Layers<'a> {
    /// The crate's `src/` directory.
    pub src: PathBuf,
    /// Top-level modules, bottom to top: a module may import the ones before it.
    pub order: &'a [&'a str],
    /// A folder module (`"broker"`, or `"a::b"` for a folder inside a folder) and its child
    /// files, bottom to top. Every folder module with child files needs its entry.
    pub folders: &'a [(&'a str, &'a [&'a str])],
    /// `(importer, imported)` pairs the order allows but the architecture does not: top-level
    /// module names, or `folder::child` names for two children of one folder.
    pub forbidden: &'a [(&'a str, &'a str)],
}

/// What [`Layers::scan`] found. Every entry names the file (relative to `src/`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Imports that run back up: into a module above the importer, or into a facade above it.
    pub upward: Vec<String>,
    /// Imports of a pair in [`Layers::forbidden`].
    pub forbidden: Vec<String>,
    /// Import cycles between files (paths relative to `src/`, sorted): files that reach each
    /// other, and a file with the facade it imports from.
    pub circles: Vec<Vec<String>>,
    /// Files of a module in no list, and listed modules without a file.
    pub unlisted: Vec<String>,
}

impl Report {
    /// No import runs back up, no forbidden pair, no circle, every module listed and present.
    pub fn holds(&self) -> bool {
        self.upward.is_empty()
            && self.forbidden.is_empty()
            && self.circles.is_empty()
            && self.unlisted.is_empty()
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut section = |title: &str, lines: Vec<String>| -> std::fmt::Result {
            if !lines.is_empty() {
                writeln!(f, "{title} ({}):", lines.len())?;
                for line in lines {
                    writeln!(f, "  {line}")?;
                }
            }
            Ok(())
        };
        section("imports that run back up", self.upward.clone())?;
        section("imports the architecture forbids", self.forbidden.clone())?;
        section(
            "import circles",
            self.circles.iter().map(|c| c.join(" <-> ")).collect(),
        )?;
        section(
            "modules not listed, or listed without a file",
            self.unlisted.clone(),
        )
    }
}

/// One source file: its module path (`[]` for the crate root) and what it imports.
struct SourceFile {
    relative: String,
    module: Vec<String>,
    paths: Vec<Vec<String>>,
}

/// Where an import leads: a module file, and whether it names the module or an item in it.
struct Target<'m> {
    module: &'m [String],
    item: Option<&'m str>,
}

impl Layers<'_> {
    /// Reads the sources and reports every violation; never panics on one.
    ///
    /// # Panics
    /// When `src` or a file under it cannot be read.
    pub fn scan(&self) -> Report {
        let mut paths = Vec::new();
        rust_files(&self.src, &mut paths);
        paths.sort();
        let files: Vec<SourceFile> = paths
            .iter()
            .filter_map(|path| {
                let relative = path.strip_prefix(&self.src).expect("under src");
                let module = module_path(relative)?;
                let source = fs::read_to_string(path)
                    .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
                Some(SourceFile {
                    relative: relative.display().to_string().replace('\\', "/"),
                    paths: imported_paths(&source)
                        .iter()
                        .filter_map(|p| resolve(&module, p))
                        .collect(),
                    module,
                })
            })
            .collect();
        let modules: BTreeMap<&[String], usize> = files
            .iter()
            .enumerate()
            .map(|(i, f)| (f.module.as_slice(), i))
            .collect();

        let mut report = Report {
            unlisted: self.unlisted(&files),
            ..Report::default()
        };
        let mut edges: BTreeSet<(usize, usize)> = BTreeSet::new();
        let mut facade_circles = BTreeSet::new();
        for (from, file) in files.iter().enumerate() {
            let mut seen = BTreeSet::new();
            for path in &file.paths {
                let Some(target) = target(&modules, path) else {
                    continue;
                };
                let to = modules[target.module];
                if to == from || !seen.insert(path.clone()) {
                    continue;
                }
                let shown = std::iter::once("crate")
                    .chain(path.iter().map(String::as_str))
                    .collect::<Vec<_>>()
                    .join("::");
                let shown = if target.item.is_some() || path.last().is_some_and(|s| s == "*") {
                    shown
                } else {
                    format!("{shown} (the module)")
                };
                if file.module.starts_with(target.module) {
                    // An item of a facade above the importer (a module declared by it is
                    // a file of its own and never lands here, except a glob of it).
                    report.upward.push(format!(
                        "{} imports {shown} from its facade {}; name the defining module",
                        file.relative, files[to].relative
                    ));
                    edges.insert((from, to));
                    facade_circles.insert((from, to));
                    continue;
                }
                if !target.module.starts_with(&file.module) {
                    edges.insert((from, to));
                } else {
                    // A facade's import of its own child: always down.
                    continue;
                }
                let shared = file
                    .module
                    .iter()
                    .zip(target.module)
                    .take_while(|(a, b)| a == b)
                    .count();
                let (own, theirs) = (&file.module[shared], &target.module[shared]);
                let (list, own_name, their_name) = if shared == 0 {
                    (Some(self.order), own.clone(), theirs.clone())
                } else {
                    let folder = file.module[..shared].join("::");
                    (
                        self.folders
                            .iter()
                            .find(|(name, _)| *name == folder)
                            .map(|(_, children)| *children),
                        format!("{folder}::{own}"),
                        format!("{folder}::{theirs}"),
                    )
                };
                let rank = |name: &str| list.and_then(|l| l.iter().position(|m| *m == name));
                if let (Some(own_rank), Some(their_rank)) = (rank(own), rank(theirs))
                    && their_rank > own_rank
                {
                    report.upward.push(format!(
                        "{} imports {shown}: {their_name} is listed above {own_name}",
                        file.relative
                    ));
                }
                if self
                    .forbidden
                    .iter()
                    .any(|&(a, b)| a == own_name && b == their_name)
                {
                    report.forbidden.push(format!(
                        "{} imports {shown}, which {own_name} must not use",
                        file.relative
                    ));
                }
            }
        }

        let name = |i: usize| files[i].relative.clone();
        let mut circles: BTreeSet<Vec<String>> = strongly_connected(files.len(), &edges)
            .into_iter()
            .filter(|c| c.len() > 1)
            .map(|c| {
                let mut c: Vec<String> = c.into_iter().map(name).collect();
                c.sort();
                c
            })
            .collect();
        circles.extend(
            facade_circles
                .into_iter()
                .map(|(child, facade)| vec![name(child), name(facade)]),
        );
        report.circles = circles.into_iter().collect();
        report
    }

    /// Panics naming each file and import that runs back up, each forbidden import, each
    /// circle and each module unlisted or absent.
    ///
    /// # Panics
    /// When the scan finds any of them.
    pub fn assert_holds(&self) {
        let report = self.scan();
        assert!(
            report.holds(),
            "the layers of {} do not hold:\n{report}",
            self.src.display()
        );
    }

    fn unlisted(&self, files: &[SourceFile]) -> Vec<String> {
        let mut unlisted = Vec::new();
        let mut present: BTreeSet<Vec<String>> = BTreeSet::new();
        for file in files.iter().filter(|f| !f.module.is_empty()) {
            present.insert(file.module.clone());
            let (parent, own) = file.module.split_at(file.module.len() - 1);
            let own = own[0].as_str();
            if parent.is_empty() {
                if !self.order.contains(&own) {
                    unlisted.push(format!(
                        "{}: module {own} is in no layer; add it to the order",
                        file.relative
                    ));
                }
                continue;
            }
            let folder = parent.join("::");
            match self.folders.iter().find(|(name, _)| *name == folder) {
                Some((_, children)) if children.contains(&own) => {}
                Some(_) => unlisted.push(format!(
                    "{}: {folder}::{own} is in no layer of {folder}; add it to its folder's order",
                    file.relative
                )),
                None => unlisted.push(format!(
                    "{}: folder {folder} has no order; add it to the folders",
                    file.relative
                )),
            }
        }
        for module in self.order {
            if !present.contains(&vec![(*module).to_owned()]) {
                unlisted.push(format!("{module}: listed, but no file defines it"));
            }
        }
        for (folder, children) in self.folders {
            for child in *children {
                let mut path: Vec<String> = folder.split("::").map(str::to_owned).collect();
                path.push((*child).to_owned());
                if !present.contains(&path) {
                    unlisted.push(format!("{folder}::{child}: listed, but no file defines it"));
                }
            }
        }
        unlisted
    }
}

/// The module path of a file under `src/`: `lib.rs` is the root, `a.rs` and `a/mod.rs` are
/// `a`, `a/b.rs` is `a::b`. `main.rs` and `bin/` are crate roots of their own: skipped.
fn module_path(relative: &Path) -> Option<Vec<String>> {
    let mut parts: Vec<String> = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let file = parts.pop()?;
    let stem = file.strip_suffix(".rs")?;
    if parts.first().is_some_and(|p| p == "bin") || (parts.is_empty() && stem == "main") {
        return None;
    }
    if !(parts.is_empty() && stem == "lib") && stem != "mod" {
        parts.push(stem.to_owned());
    }
    Some(parts)
}

/// `path` (as written in the file of `module`) from the crate root; `None` for a `super::`
/// above the root.
fn resolve(module: &[String], path: &[String]) -> Option<Vec<String>> {
    let (first, rest) = path.split_first()?;
    let mut base: Vec<String> = match first.as_str() {
        "crate" => Vec::new(),
        "self" => module.to_vec(),
        "super" => {
            let mut base = module.to_vec();
            base.pop()?;
            base
        }
        _ => return None,
    };
    let mut rest = rest.iter().peekable();
    while rest.peek().is_some_and(|s| *s == "super") {
        base.pop()?;
        rest.next();
    }
    base.extend(rest.filter(|s| *s != "self").cloned());
    Some(base)
}

/// The file module `path` leads to (the longest known prefix), and the item it names there;
/// `None` when not even the root has a file.
fn target<'m>(modules: &BTreeMap<&'m [String], usize>, path: &'m [String]) -> Option<Target<'m>> {
    (0..=path.len()).rev().find_map(|len| {
        let (module, _) = modules.get_key_value(&path[..len])?;
        Some(Target {
            module,
            item: path.get(len).map(String::as_str).filter(|s| *s != "*"),
        })
    })
}

/// Every `crate::`, `super::` and `self::` path in `source`, as segments, one per leaf of a
/// grouped `use`; outside comments, string and character literals, and `#[cfg(test)]` modules.
fn imported_paths(source: &str) -> Vec<Vec<String>> {
    let code = without_test_modules(&code_only(source));
    let chars: Vec<char> = code.chars().collect();
    let inline = inline_module_depths(&chars);
    let mut found = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let starts_ident = i == 0 || !(is_ident(chars[i - 1]) || chars[i - 1] == '$');
        let keyword = ["crate", "super", "self"]
            .into_iter()
            .find(|k| starts_ident && matches_at(&chars, i, &format!("{k}::")));
        let Some(keyword) = keyword else {
            i += 1;
            continue;
        };
        // `pub(in crate::a)` is a visibility, not an import.
        let before: String = chars[..i].iter().collect();
        if before.trim_end().ends_with("(in") {
            i += keyword.len();
            continue;
        }
        let mut at = i;
        let mut paths = Vec::new();
        path_tree(&chars, &mut at, Vec::new(), &mut paths);
        found.extend(
            paths
                .into_iter()
                .filter_map(|path| from_file_module(path, inline[i])),
        );
        i = at.max(i + 1);
    }
    found
}

/// `path`, written `depth` inline modules (`mod name { … }`) deep in a file, as the file's
/// module would write it; `None` when it stays inside the file (`self::`, or no more
/// `super::` than inline modules), which imports nothing from another file.
fn from_file_module(path: Vec<String>, depth: usize) -> Option<Vec<String>> {
    if depth == 0 || path.first().is_some_and(|s| s == "crate") {
        return Some(path);
    }
    if path.first().is_some_and(|s| s == "self") {
        return None;
    }
    let supers = path.iter().take_while(|s| *s == "super").count();
    (supers > depth).then(|| path[depth..].to_vec())
}

/// For each character of `chars`, how many inline modules (`mod name { … }`) enclose it.
fn inline_module_depths(chars: &[char]) -> Vec<usize> {
    let mut depths = vec![0; chars.len()];
    // The brace depth at which each open inline module's block began.
    let mut open: Vec<usize> = Vec::new();
    let mut braces = 0;
    let mut i = 0;
    while i < chars.len() {
        let starts_ident = i == 0 || !is_ident(chars[i - 1]);
        if starts_ident && matches_at(chars, i, "mod") {
            let mut at = i + 3;
            let spaced = chars.get(at).is_some_and(|c| c.is_whitespace());
            skip_space(chars, &mut at);
            let name_start = at;
            while chars.get(at).is_some_and(|c| is_ident(*c)) {
                at += 1;
            }
            skip_space(chars, &mut at);
            if spaced && at > name_start && chars.get(at) == Some(&'{') {
                for depth in &mut depths[i..=at] {
                    *depth = open.len();
                }
                open.push(braces);
                braces += 1;
                i = at + 1;
                continue;
            }
        }
        match chars[i] {
            '{' => braces += 1,
            '}' => {
                braces = braces.saturating_sub(1);
                if open.last() == Some(&braces) {
                    open.pop();
                }
            }
            _ => {}
        }
        depths[i] = open.len();
        i += 1;
    }
    depths
}

/// Reads one path or group at `at`, appending to `prefix`; pushes each complete path.
fn path_tree(chars: &[char], at: &mut usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    skip_space(chars, at);
    match chars.get(*at) {
        Some('{') => {
            *at += 1;
            loop {
                skip_space(chars, at);
                match chars.get(*at) {
                    None => return,
                    Some('}') => {
                        *at += 1;
                        return;
                    }
                    Some(',') => *at += 1,
                    Some(_) => {
                        let before = *at;
                        path_tree(chars, at, prefix.clone(), out);
                        skip_space(chars, at);
                        // `item as alias`
                        if matches_at(chars, *at, "as")
                            && !chars.get(*at + 2).is_some_and(|c| is_ident(*c))
                        {
                            *at += 2;
                            skip_space(chars, at);
                            while chars.get(*at).is_some_and(|c| is_ident(*c)) {
                                *at += 1;
                            }
                        }
                        if *at == before {
                            // Nothing this reader understands: skip a character.
                            *at += 1;
                        }
                    }
                }
            }
        }
        Some('*') => {
            *at += 1;
            let mut path = prefix;
            path.push("*".into());
            out.push(path);
        }
        Some(c) if is_ident(*c) => {
            let start = *at;
            while chars.get(*at).is_some_and(|c| is_ident(*c)) {
                *at += 1;
            }
            let mut path = prefix;
            path.push(chars[start..*at].iter().collect());
            let mut next = *at;
            skip_space(chars, &mut next);
            if matches_at(chars, next, "::") {
                let mut after = next + 2;
                skip_space(chars, &mut after);
                if chars
                    .get(after)
                    .is_some_and(|c| is_ident(*c) || *c == '{' || *c == '*')
                {
                    *at = after;
                    path_tree(chars, at, path, out);
                    return;
                }
            }
            out.push(path);
        }
        _ => {
            if !prefix.is_empty() {
                out.push(prefix);
            }
        }
    }
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

fn matches_at(chars: &[char], at: usize, text: &str) -> bool {
    text.chars()
        .enumerate()
        .all(|(k, t)| chars.get(at + k) == Some(&t))
}

fn skip_space(chars: &[char], at: &mut usize) {
    while chars.get(*at).is_some_and(|c| c.is_whitespace()) {
        *at += 1;
    }
}

/// `source` with comments, string literals and character literals blanked out (newlines kept).
fn code_only(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    let blank = |out: &mut String, c: char| out.push(if c == '\n' { '\n' } else { ' ' });
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
            }
        } else if c == 'r'
            && (next == Some('"') || next == Some('#'))
            && (i == 0 || !is_ident(chars[i - 1]))
            && raw_string_end(&chars, i).is_some()
        {
            let end = raw_string_end(&chars, i).expect("checked");
            for &c in &chars[i..end] {
                blank(&mut out, c);
            }
            i = end;
        } else if c == '"' {
            blank(&mut out, c);
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
                if i < chars.len() {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
            }
            if i < chars.len() {
                blank(&mut out, chars[i]);
                i += 1;
            }
        } else if c == '\'' {
            // A character literal (`'x'`, `'\n'`, `'\u{..}'`); otherwise a lifetime.
            let end = if next == Some('\\') {
                (i + 2..chars.len().min(i + 12)).find(|&j| chars[j] == '\'')
            } else if chars.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(end) => {
                    for &c in &chars[i..=end] {
                        blank(&mut out, c);
                    }
                    i = end + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Where the raw string literal starting at `at` (`r"…"`, `r#"…"#`) ends, exclusive.
fn raw_string_end(chars: &[char], at: usize) -> Option<usize> {
    let mut i = at + 1;
    let mut hashes = 0;
    while chars.get(i) == Some(&'#') {
        hashes += 1;
        i += 1;
    }
    if chars.get(i) != Some(&'"') {
        return None;
    }
    i += 1;
    while i < chars.len() {
        if chars[i] == '"' && (1..=hashes).all(|k| chars.get(i + k) == Some(&'#')) {
            return Some(i + 1 + hashes);
        }
        i += 1;
    }
    None
}

/// `code` (comments already gone) without `#[cfg(test)] mod name { … }` blocks.
fn without_test_modules(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(start) = rest.find("#[cfg(test)]") {
        let after = &rest[start + "#[cfg(test)]".len()..];
        let trimmed = after.trim_start();
        let is_module = trimmed
            .strip_prefix("mod")
            .is_some_and(|m| m.starts_with(char::is_whitespace));
        let open = trimmed.find(['{', ';']);
        match (is_module, open) {
            (true, Some(open)) if trimmed.as_bytes()[open] == b'{' => {
                out.push_str(&rest[..start]);
                let body = &trimmed[open..];
                let mut depth = 0usize;
                let mut end = body.len();
                for (j, c) in body.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = j + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                // Keep the line count, for nothing but tidiness.
                out.extend(body[..end].chars().filter(|c| *c == '\n'));
                rest = &body[end..];
            }
            _ => {
                out.push_str(&rest[..start + "#[cfg(test)]".len()]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries =
        fs::read_dir(dir).unwrap_or_else(|e| panic!("reading directory {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Tarjan's strongly connected components of a graph of `n` nodes.
fn strongly_connected(n: usize, edges: &BTreeSet<(usize, usize)>) -> Vec<Vec<usize>> {
    let mut next: Vec<Vec<usize>> = vec![Vec::new(); n];
    for &(a, b) in edges {
        next[a].push(b);
    }
    struct State {
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        counter: usize,
        components: Vec<Vec<usize>>,
    }
    fn visit(v: usize, next: &[Vec<usize>], s: &mut State) {
        s.index[v] = Some(s.counter);
        s.low[v] = s.counter;
        s.counter += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for &w in &next[v] {
            match s.index[w] {
                None => {
                    visit(w, next, s);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                component.push(w);
                if w == v {
                    break;
                }
            }
            s.components.push(component);
        }
    }
    let mut state = State {
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        counter: 0,
        components: Vec::new(),
    };
    for v in 0..n {
        if state.index[v].is_none() {
            visit(v, &next, &mut state);
        }
    }
    state.components
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(source: &str) -> Vec<String> {
        imported_paths(source)
            .into_iter()
            .map(|p| p.join("::"))
            .collect()
    }

    #[test]
    fn grouped_paths_give_one_path_per_leaf() {
        let source = "use crate::{a::X, b, c::{Y, d::Z as W, self}, e::*};\n\
                      use super::{f::{g, h::I}};\n\
                      fn f() { crate::d::g::<u8>(); self::k::L::new(); }\n";
        assert_eq!(
            paths(source),
            [
                "crate::a::X",
                "crate::b",
                "crate::c::Y",
                "crate::c::d::Z",
                "crate::c::self",
                "crate::e::*",
                "super::f::g",
                "super::f::h::I",
                "crate::d::g",
                "self::k::L::new",
            ]
        );
    }

    #[test]
    fn comments_strings_and_unit_tests_are_ignored() {
        let source = "// crate::a::X in a comment\n\
                      /// [`crate::b`] in a doc comment\n\
                      /* crate::c::Y /* nested */ crate::c::Z */\n\
                      fn f() -> char { let _ = \"crate::d::W\"; let _ = r#\"super::e\"#; '\"' }\n\
                      fn g<'a>(x: &'a crate::f::V) {}\n\
                      pub(in crate::g) fn h() {}\n\
                      #[cfg(test)]\nmod tests {\n    use super::*;\n    use crate::h::T;\n}\n\
                      fn after() { super::i::j(); }\n";
        assert_eq!(paths(source), ["crate::f::V", "super::i::j"]);
    }

    #[test]
    fn paths_in_inline_modules_are_read_from_the_file_module() {
        let source = "use super::a::B;\n\
                      mod statements {\n    use super::COLUMNS;\n    use self::inner::X;\n    \
                      use super::super::c::D;\n    fn f() { crate::e::F; }\n}\n\
                      fn after() { super::g::H; }\n";
        assert_eq!(
            paths(source),
            ["super::a::B", "super::c::D", "crate::e::F", "super::g::H"]
        );
    }

    #[test]
    fn super_and_self_resolve_from_the_file_module() {
        let module = |m: &str| m.split("::").map(str::to_owned).collect::<Vec<_>>();
        let path = |p: &str| p.split("::").map(str::to_owned).collect::<Vec<_>>();
        let child = module("broker::publish");
        assert_eq!(
            resolve(&child, &path("super::session::Item")),
            Some(module("broker::session::Item"))
        );
        assert_eq!(
            resolve(&child, &path("super::super::status::X")),
            Some(module("status::X"))
        );
        assert_eq!(
            resolve(&child, &path("self::Local")),
            Some(module("broker::publish::Local"))
        );
        let facade = module("broker");
        assert_eq!(
            resolve(&facade, &path("super::status")),
            Some(module("status"))
        );
        assert_eq!(
            resolve(&facade, &path("self::tls::AmqpTls")),
            Some(module("broker::tls::AmqpTls"))
        );
        assert_eq!(resolve(&[], &path("super::x")), None);
    }

    /// A scratch `src/` directory, removed when dropped.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(files: &[(&str, &str)]) -> Self {
            let dir = std::env::temp_dir().join(format!("layering-{}", crate::unique_suffix()));
            for (path, text) in files {
                let path = dir.join(path);
                fs::create_dir_all(path.parent().expect("a parent")).expect("create dir");
                fs::write(path, text).expect("write file");
            }
            Self(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    const ORDER: &[&str] = &["status", "broker", "consumer"];
    const BROKER: &[&str] = &["tls", "addresses", "session"];

    fn layers<'a>(src: &Scratch, forbidden: &'a [(&'a str, &'a str)]) -> Layers<'a> {
        Layers {
            src: src.0.clone(),
            order: ORDER,
            folders: &[("broker", BROKER)],
            forbidden,
        }
    }

    fn clean_crate() -> Vec<(&'static str, &'static str)> {
        vec![
            (
                "lib.rs",
                "pub mod status;\npub mod broker;\nmod consumer;\npub use status::Outcome;\n",
            ),
            ("status.rs", "pub enum Outcome {}\n"),
            (
                "broker/mod.rs",
                "mod tls;\nmod addresses;\nmod session;\npub use session::Session;\nuse crate::status::Outcome;\n",
            ),
            ("broker/tls.rs", "pub fn redacted() {}\n"),
            (
                "broker/addresses.rs",
                "use super::tls::redacted;\npub fn connect() { redacted() }\n",
            ),
            (
                "broker/session.rs",
                "use super::{addresses::connect, tls};\nuse crate::status::Outcome;\npub struct Session;\n",
            ),
            (
                "consumer.rs",
                "use crate::{Outcome as _O, broker::Session, status};\n",
            ),
        ]
    }

    #[test]
    fn a_crate_that_points_down_holds() {
        let src = Scratch::new(&clean_crate());
        let report = layers(&src, &[]).scan();
        // `crate::Outcome` from consumer.rs is a root re-export: the one finding.
        assert_eq!(report.upward.len(), 1, "{report}");
        assert!(
            report.upward[0]
                .starts_with("consumer.rs imports crate::Outcome from its facade lib.rs")
        );
        assert_eq!(report.circles, [["consumer.rs", "lib.rs"]]);
        assert!(
            report.unlisted.is_empty() && report.forbidden.is_empty(),
            "{report}"
        );
    }

    #[test]
    fn facade_items_upward_modules_and_cycles_are_found() {
        let mut files = clean_crate();
        files.retain(|(p, _)| {
            !matches!(
                *p,
                "consumer.rs"
                    | "broker/addresses.rs"
                    | "broker/mod.rs"
                    | "status.rs"
                    | "broker/tls.rs"
            )
        });
        files.extend([
            ("consumer.rs", "use crate::{broker::Session, status};\n"),
            // `connect` lives in the facade: children import it from above.
            ("broker/mod.rs", "mod tls;\nmod addresses;\nmod session;\npub use session::Session;\npub fn connect() {}\n"),
            ("broker/addresses.rs", "use super::{connect, session::Session};\n"),
            ("status.rs", "use crate::consumer;\npub enum Outcome {}\n"),
            ("broker/tls.rs", "pub fn redacted() { super::addresses::x(); }\n"),
            ("extra.rs", ""),
        ]);
        let src = Scratch::new(&files);
        let report = layers(&src, &[("consumer", "status")]).scan();
        let upward = report.upward.join("\n");
        assert!(
            upward.contains(
                "broker/addresses.rs imports crate::broker::connect from its facade broker/mod.rs"
            ),
            "{upward}"
        );
        assert!(upward.contains("broker/addresses.rs imports crate::broker::session::Session: broker::session is listed above broker::addresses"), "{upward}");
        assert!(
            upward.contains("broker/tls.rs imports crate::broker::addresses::x"),
            "{upward}"
        );
        assert!(
            upward.contains(
                "status.rs imports crate::consumer (the module): consumer is listed above status"
            ),
            "{upward}"
        );
        assert_eq!(report.upward.len(), 4, "{upward}");
        assert_eq!(report.forbidden.len(), 1, "{report}");
        assert!(report.forbidden[0].starts_with("consumer.rs imports crate::status (the module)"));
        assert_eq!(
            report.circles,
            [
                vec!["broker/addresses.rs", "broker/mod.rs"],
                vec!["broker/addresses.rs", "broker/session.rs", "broker/tls.rs"],
                vec!["consumer.rs", "status.rs"],
            ]
        );
        assert_eq!(
            report.unlisted,
            ["extra.rs: module extra is in no layer; add it to the order"]
        );
        assert!(!report.holds());
    }

    #[test]
    fn unlisted_and_absent_modules_are_named() {
        let mut files = clean_crate();
        files.push(("broker/frames.rs", ""));
        files.retain(|(p, _)| *p != "broker/tls.rs");
        let src = Scratch::new(&files);
        let unlisted = layers(&src, &[]).scan().unlisted;
        assert_eq!(
            unlisted,
            [
                "broker/frames.rs: broker::frames is in no layer of broker; add it to its folder's order",
                "broker::tls: listed, but no file defines it",
            ]
        );
    }

    #[test]
    #[should_panic(expected = "broker/addresses.rs imports crate::broker::connect from its facade")]
    fn assert_holds_names_the_import() {
        let mut files = clean_crate();
        files.retain(|(p, _)| !matches!(*p, "consumer.rs" | "broker/addresses.rs"));
        files.extend([
            ("consumer.rs", "use crate::broker::Session;\n"),
            ("broker/addresses.rs", "use super::connect;\n"),
        ]);
        let src = Scratch::new(&files);
        layers(&src, &[]).assert_holds();
    }
}
