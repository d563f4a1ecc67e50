//! A small argument parser: `--name value`, `--name=value` and flags, with
//! one-line errors naming the offending token.

use udm_core::Error;

/// The arguments of one subcommand, consumed as they are read.
pub struct Args {
    cmd: &'static str,
    items: Vec<Option<String>>,
}

impl Args {
    /// Wraps `args` (after the subcommand name).
    pub fn new(cmd: &'static str, args: Vec<String>) -> Args {
        // Split --name=value into two items so both spellings read alike.
        let mut items = Vec::new();
        for a in args {
            match a.split_once('=') {
                Some((n, v)) if n.starts_with("--") => {
                    items.push(Some(n.to_string()));
                    items.push(Some(v.to_string()));
                }
                _ => items.push(Some(a)),
            }
        }
        Args { cmd, items }
    }

    fn take_value(&mut self, i: usize, name: &str) -> Result<String, Error> {
        self.items[i] = None;
        match self.items.get_mut(i + 1).and_then(Option::take) {
            Some(v) => Ok(v),
            None => Err(Error::invalid(format!("{name}: missing value"))),
        }
    }

    /// Every value of a repeatable option.
    pub fn many(&mut self, name: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.items.len() {
            if self.items[i].as_deref() == Some(name) {
                if let Ok(v) = self.take_value(i, name) {
                    out.push(v);
                }
            }
            i += 1;
        }
        out
    }

    /// The value of an option given at most once (the last one wins).
    pub fn opt(&mut self, name: &str) -> Option<String> {
        self.many(name).pop()
    }

    /// A numeric option with a default.
    pub fn num(&mut self, name: &str, default: u32) -> Result<u32, Error> {
        match self.opt(name) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| {
                Error::invalid(format!("{name} '{v}': expected a non-negative integer"))
            }),
        }
    }

    /// Whether a flag is present.
    pub fn flag(&mut self, name: &str) -> bool {
        let mut found = false;
        for it in self.items.iter_mut() {
            if it.as_deref() == Some(name) {
                *it = None;
                found = true;
            }
        }
        found
    }

    /// The arguments left that are not options, in order (read options first).
    pub fn rest(&mut self) -> Vec<String> {
        self.items
            .iter_mut()
            .filter(|it| it.as_deref().is_some_and(|a| !a.starts_with('-')))
            .filter_map(Option::take)
            .collect()
    }

    /// Fails on anything not consumed.
    pub fn finish(self) -> Result<(), Error> {
        match self.items.into_iter().flatten().next() {
            None => Ok(()),
            Some(a) if a.starts_with('-') => Err(Error::invalid(format!(
                "unknown option '{a}' for 'udm {}' (see 'udm {} --help')",
                self.cmd, self.cmd
            ))),
            Some(a) => Err(Error::invalid(format!(
                "unexpected argument '{a}' for 'udm {}'",
                self.cmd
            ))),
        }
    }

    /// Whether help was asked for.
    pub fn wants_help(&self) -> bool {
        self.items
            .iter()
            .flatten()
            .any(|a| a == "--help" || a == "-h")
    }
}
