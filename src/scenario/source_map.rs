//! Where each key of a scenario file sits in the text.
//!
//! The typed parse (serde structs) forgets positions, so the text is parsed a second
//! time into a bare tree that keeps the byte span of every key (and of every array
//! element, which has no key). Flattened, this gives dotted paths such as
//! `evolution.crossover[1].op` with their spans, which answers two questions:
//! "on which line is key K?" (for range errors) and "which key does toml's error
//! span belong to?" (for unknown keys, wrong types and missing keys).

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use std::fmt;
use std::ops::Range;
use toml::Spanned;

/// Flattened key positions of one scenario text.
#[derive(Debug, Default)]
pub(crate) struct SourceMap {
    /// One entry per key and per array element, in text order of discovery.
    entries: Vec<Entry>,
    /// Byte offset where each line starts (line 1 starts at 0).
    line_starts: Vec<usize>,
}

#[derive(Debug)]
struct Entry {
    /// Dotted path, e.g. `lora.rank`, `events[0]`, `events[0].inject.from[1]`.
    path: String,
    /// Span of the key (or, for array elements, of the element's value).
    span: Range<usize>,
    /// Nesting depth (top-level keys are 1).
    depth: usize,
}

impl SourceMap {
    /// A map that knows line starts but no keys (used when the key tree cannot be built).
    pub(crate) fn lines_only(text: &str) -> SourceMap {
        SourceMap {
            entries: Vec::new(),
            line_starts: line_starts(text),
        }
    }

    /// Parses `text` as a bare TOML tree; fails exactly when the text is not valid TOML.
    pub(crate) fn build(text: &str) -> Result<SourceMap, toml::de::Error> {
        let root: Node = toml::from_str(text)?;
        let mut map = SourceMap::lines_only(text);
        map.flatten(&root, "", 0);
        Ok(map)
    }

    fn flatten(&mut self, node: &Node, prefix: &str, depth: usize) {
        match node {
            Node::Table(children) => {
                for (key, value) in children {
                    let path = if prefix.is_empty() {
                        key.get_ref().0.clone()
                    } else {
                        format!("{prefix}.{}", key.get_ref().0)
                    };
                    self.entries.push(Entry {
                        path: path.clone(),
                        span: key.span(),
                        depth: depth + 1,
                    });
                    self.flatten(value, &path, depth + 1);
                }
            }
            Node::Array(elements) => {
                for (index, element) in elements.iter().enumerate() {
                    let path = format!("{prefix}[{index}]");
                    self.entries.push(Entry {
                        path: path.clone(),
                        span: element.span(),
                        depth: depth + 1,
                    });
                    self.flatten(element.get_ref(), &path, depth + 1);
                }
            }
            Node::Leaf => {}
        }
    }

    /// 1-based line containing byte `offset`.
    pub(crate) fn line_of_offset(&self, offset: usize) -> usize {
        self.line_starts
            .partition_point(|&start| start <= offset)
            .max(1)
    }

    /// Whether the file gives `path` explicitly.
    pub(crate) fn contains(&self, path: &str) -> bool {
        self.entries.iter().any(|entry| entry.path == path)
    }

    /// Line of `path`, or of its nearest enclosing key that the file gives.
    pub(crate) fn line_of_key(&self, path: &str) -> Option<usize> {
        let mut path = path;
        loop {
            if let Some(entry) = self.entries.iter().find(|entry| entry.path == path) {
                return Some(self.line_of_offset(entry.span.start));
            }
            path = parent_path(path)?;
        }
    }

    /// The key path that toml's error span refers to ("" for the document root).
    ///
    /// toml's spans are: a key (unknown key), a value (wrong type, bad variant), an
    /// array element, an inline table, or a table with its `[header]` (missing key).
    pub(crate) fn path_at(&self, span: &Range<usize>) -> String {
        let preceding = self.preceding(span);
        let Some(first) = self.earliest_covered(span) else {
            // A scalar or an empty inline table: the value of the key before it.
            return preceding
                .map(|entry| entry.path.clone())
                .unwrap_or_default();
        };
        if first.span.start == span.start {
            // The span is the key itself, or an array element.
            return first.path.clone();
        }
        let line = self.line_of_offset(span.start);
        if let Some(key) = preceding {
            let inline_value =
                self.line_of_offset(key.span.start) == line && is_ancestor(&key.path, &first.path);
            if inline_value {
                // `key = { ... }` or `key = [ ... ]`.
                return key.path.clone();
            }
        }
        // A `[header]` table: the deepest key on the header line names it.
        self.entries
            .iter()
            .filter(|entry| covers(span, entry) && self.line_of_offset(entry.span.start) == line)
            .max_by_key(|entry| entry.depth)
            .unwrap_or(first)
            .path
            .clone()
    }

    fn earliest_covered(&self, span: &Range<usize>) -> Option<&Entry> {
        self.entries
            .iter()
            .filter(|entry| covers(span, entry))
            .min_by_key(|entry| (entry.span.start, entry.depth))
    }

    fn preceding(&self, span: &Range<usize>) -> Option<&Entry> {
        self.entries
            .iter()
            .filter(|entry| entry.span.start <= span.start)
            .max_by_key(|entry| (entry.span.start, entry.depth))
    }
}

fn covers(span: &Range<usize>, entry: &Entry) -> bool {
    entry.span.start >= span.start && entry.span.start < span.end
}

/// `a` is a proper ancestor of `a.b`, `a[0]`, `a[0].c`.
fn is_ancestor(ancestor: &str, path: &str) -> bool {
    path.len() > ancestor.len()
        && path.starts_with(ancestor)
        && matches!(path.as_bytes()[ancestor.len()], b'.' | b'[')
}

/// `a.b[2].c` → `a.b[2]` → `a.b` → `a` → None.
pub(crate) fn parent_path(path: &str) -> Option<&str> {
    if path.ends_with(']') {
        return path.rfind('[').map(|at| &path[..at]);
    }
    path.rfind('.').map(|at| &path[..at])
}

fn line_starts(text: &str) -> Vec<usize> {
    std::iter::once(0)
        .chain(text.match_indices('\n').map(|(at, _)| at + 1))
        .collect()
}

/// A TOML value with only the structure and the spans kept.
enum Node {
    Table(Vec<(Spanned<Key>, Node)>),
    Array(Vec<Spanned<Node>>),
    Leaf,
}

/// A table key (toml hands keys over as borrowed or owned strings).
struct Key(String);

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E>(self, key: &str) -> Result<Key, E> {
                Ok(Key(key.to_string()))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct NodeVisitor;
        impl<'de> Visitor<'de> for NodeVisitor {
            type Value = Node;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any TOML value")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Node, M::Error> {
                let mut children = Vec::new();
                while let Some(key) = map.next_key::<Spanned<Key>>()? {
                    children.push((key, map.next_value::<Node>()?));
                }
                Ok(Node::Table(children))
            }
            fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Node, S::Error> {
                let mut elements = Vec::new();
                while let Some(element) = seq.next_element::<Spanned<Node>>()? {
                    elements.push(element);
                }
                Ok(Node::Array(elements))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Node, E> {
                Ok(Node::Leaf)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Node, E> {
                Ok(Node::Leaf)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Node, E> {
                Ok(Node::Leaf)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Node, E> {
                Ok(Node::Leaf)
            }
            fn visit_str<E>(self, _: &str) -> Result<Node, E> {
                Ok(Node::Leaf)
            }
        }
        deserializer.deserialize_any(NodeVisitor)
    }
}
