//! Bearer tokens in three scopes, each including the one before: `read` (inspection metadata,
//! metrics), `read:payload` (also messages' payloads, headers and error texts, each read
//! audited) and `admin` (also operator actions). Each token has a name, which is what the audit
//! trail records as the actor; the secret itself is never logged, printed or stored.
//!
//! `admin` implies `read:payload`: an operator deciding to reopen or redrive a message has to
//! see what it holds, and the admin token is already the most trusted one. Its payload reads
//! are audited all the same.
//!
//! Secrets must carry at least [`MIN_SECRET_BITS`] bits of entropy, estimated from their length
//! and the character classes they use (32 hex digits, 22 random base64 characters).
//!
//! Presented tokens are compared against every configured token in constant time (SHA-256
//! digests compared with `subtle`, no early exit), so response timing tells nothing about
//! which token, or how much of one, matched.

use std::{fmt, net::SocketAddr};

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Shortest secret accepted whatever its alphabet (22 base64 characters are 132 bits).
pub const MIN_SECRET_LEN: usize = 22;

/// Least entropy a secret must carry, estimated by [`secret_bits`]: a guessable token is no
/// protection.
pub const MIN_SECRET_BITS: f64 = 128.0;

/// What a token may do. Each scope includes the ones before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scope {
    /// Inspection metadata (statuses, counts, ids, error codes) and metrics.
    Read,
    /// Also messages' payloads, headers and error texts; every such read is audited.
    ReadPayload,
    /// Operator actions (mutating), and everything `ReadPayload` may do.
    Admin,
}

impl Scope {
    /// `read`, `read:payload` or `admin`.
    pub fn parse(text: &str) -> Result<Self, TokenError> {
        match text {
            "read" => Ok(Self::Read),
            "read:payload" => Ok(Self::ReadPayload),
            "admin" => Ok(Self::Admin),
            other => Err(TokenError(format!(
                "unknown token scope {other:?} (expected read, read:payload or admin)"
            ))),
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Read => "read",
            Self::ReadPayload => "read:payload",
            Self::Admin => "admin",
        })
    }
}

/// Estimated entropy of `secret` in bits: its length times log2 of the alphabet its character
/// classes span (hex digits count as 16 symbols). An estimate that assumes random characters;
/// a secret made of a handful of symbols (`aaaa…`, `abab…`) is judged by those it uses.
pub fn secret_bits(secret: &str) -> f64 {
    let chars: Vec<char> = secret.chars().collect();
    let is_hex = |c: &char| c.is_ascii_hexdigit();
    let alphabet = if chars.iter().all(is_hex)
        && (chars.iter().all(|c| !c.is_ascii_uppercase())
            || chars.iter().all(|c| !c.is_ascii_lowercase()))
    {
        16
    } else {
        type Class = fn(&char) -> bool;
        let classes: [(Class, usize); 4] = [
            (char::is_ascii_lowercase, 26),
            (char::is_ascii_uppercase, 26),
            (char::is_ascii_digit, 10),
            (|c: &char| !c.is_ascii_alphanumeric(), 32),
        ];
        classes
            .iter()
            .filter(|(class, _)| chars.iter().any(class))
            .map(|(_, size)| size)
            .sum()
    };
    let mut distinct = chars.clone();
    distinct.sort_unstable();
    distinct.dedup();
    // Random secrets use most of their alphabet; fewer than 8 symbols is a pattern.
    let alphabet = if distinct.len() < 8 {
        alphabet.min(distinct.len())
    } else {
        alphabet
    };
    let alphabet = alphabet.max(1) as f64;
    chars.len() as f64 * alphabet.log2()
}

/// A token configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TokenError(String);

struct Token {
    name: String,
    scope: Scope,
    digest: [u8; 32],
}

/// The configured tokens. `Debug` shows names and scopes only.
#[derive(Default)]
pub struct Tokens {
    tokens: Vec<Token>,
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(
                self.tokens
                    .iter()
                    .map(|t| format!("{}:{}", t.scope, t.name)),
            )
            .finish()
    }
}

/// Who a request authenticated as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The token's name (the audit trail's actor).
    pub name: String,
    /// The token's scope.
    pub scope: Scope,
}

fn digest(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

impl Tokens {
    /// No tokens: read endpoints are open, mutating ones refused, and only a loopback address
    /// may be bound.
    pub fn none() -> Self {
        Self::default()
    }

    /// Adds a token. Names must be unique and non-blank, secrets unique, at least
    /// [`MIN_SECRET_LEN`] characters and [`MIN_SECRET_BITS`] bits of estimated entropy.
    pub fn add(&mut self, scope: Scope, name: &str, secret: &str) -> Result<(), TokenError> {
        let name = name.trim();
        if name.is_empty() || name.chars().any(char::is_whitespace) {
            return Err(TokenError(format!(
                "token name {name:?} must be non-blank, without spaces"
            )));
        }
        if secret.chars().count() < MIN_SECRET_LEN {
            return Err(TokenError(format!(
                "the {scope} token {name:?} is shorter than {MIN_SECRET_LEN} characters; \
                 generate one with `openssl rand -hex 32`"
            )));
        }
        let bits = secret_bits(secret);
        if bits < MIN_SECRET_BITS {
            return Err(TokenError(format!(
                "the {scope} token {name:?} carries about {bits:.0} bits of entropy, under \
                 {MIN_SECRET_BITS}; generate one with `openssl rand -hex 32`"
            )));
        }
        if self.tokens.iter().any(|t| t.name == name) {
            return Err(TokenError(format!(
                "token name {name:?} is configured twice"
            )));
        }
        let digest = digest(secret);
        if self.tokens.iter().any(|t| t.digest == digest) {
            return Err(TokenError(format!(
                "the secret of token {name:?} is also another token's"
            )));
        }
        self.tokens.push(Token {
            name: name.to_owned(),
            scope,
            digest,
        });
        Ok(())
    }

    /// Adds `name=secret` pairs separated by commas (or newlines), as in the
    /// `INBOX_ADMIN_READ_TOKENS`, `INBOX_ADMIN_PAYLOAD_TOKENS` and `INBOX_ADMIN_ADMIN_TOKENS`
    /// variables.
    pub fn add_pairs(&mut self, scope: Scope, pairs: &str) -> Result<(), TokenError> {
        for pair in pairs
            .split([',', '\n'])
            .map(str::trim)
            .filter(|p| !p.is_empty())
        {
            let (name, secret) = pair.split_once('=').ok_or_else(|| {
                TokenError(format!(
                    "expected NAME=TOKEN in the {scope} tokens, got an entry without '='"
                ))
            })?;
            self.add(scope, name, secret.trim())?;
        }
        Ok(())
    }

    /// Adds the tokens of a file: one `SCOPE NAME=TOKEN` per line (`read grafana=...`,
    /// `read:payload support=...`, `admin oncall=...`); blank lines and lines starting with
    /// `#` are skipped.
    pub fn add_file(&mut self, text: &str) -> Result<(), TokenError> {
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (scope, pair) = line.split_once(char::is_whitespace).ok_or_else(|| {
                TokenError(format!(
                    "line {}: expected SCOPE NAME=TOKEN (scope read, read:payload or admin)",
                    n + 1
                ))
            })?;
            let scope = Scope::parse(scope.trim())
                .map_err(|e| TokenError(format!("line {}: {e}", n + 1)))?;
            self.add_pairs(scope, pair)
                .map_err(|e| TokenError(format!("line {}: {e}", n + 1)))?;
        }
        Ok(())
    }

    /// No token is configured.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// How many tokens of `scope` are configured.
    pub fn count(&self, scope: Scope) -> usize {
        self.tokens.iter().filter(|t| t.scope == scope).count()
    }

    /// The token `presented` matches, compared against every configured token in constant
    /// time.
    pub fn authenticate(&self, presented: &str) -> Option<Caller> {
        let presented = digest(presented);
        let mut found = None;
        for token in &self.tokens {
            // No early exit: every token is compared whatever matched before.
            if bool::from(token.digest.ct_eq(&presented)) {
                found = Some(Caller {
                    name: token.name.clone(),
                    scope: token.scope,
                });
            }
        }
        found
    }

    /// Refuses an address other machines can reach when no token protects it.
    pub fn check_bind(&self, addr: SocketAddr) -> Result<(), TokenError> {
        if self.is_empty() && !addr.ip().is_loopback() {
            return Err(TokenError(format!(
                "refusing to listen on {addr} without tokens: anyone who can reach it could read \
                 the inbox. Configure read and admin tokens (INBOX_ADMIN_READ_TOKENS, \
                 INBOX_ADMIN_ADMIN_TOKENS or --tokens-file), or listen on a loopback address \
                 such as 127.0.0.1"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "Zq8Jd0wYbL3mT7xR2vKp9s";
    const ADMIN_SECRET: &str = "d1f0c3b2a5e4978681726354f0e1d2c3";

    #[test]
    fn tokens_authenticate_by_secret_and_name_the_caller() {
        let mut tokens = Tokens::none();
        tokens
            .add_pairs(Scope::Read, &format!("grafana={SECRET}"))
            .expect("valid");
        tokens
            .add_file(&format!("# on-call\nadmin alice={ADMIN_SECRET}\n\n"))
            .expect("valid");
        assert_eq!(
            tokens.authenticate(SECRET),
            Some(Caller {
                name: "grafana".into(),
                scope: Scope::Read
            })
        );
        assert_eq!(
            tokens.authenticate(ADMIN_SECRET).map(|c| c.scope),
            Some(Scope::Admin)
        );
        assert_eq!(tokens.authenticate(&SECRET[..16]), None);
        assert_eq!(tokens.authenticate(""), None);
        assert!(
            !format!("{tokens:?}").contains(SECRET),
            "Debug hides secrets"
        );
    }

    #[test]
    fn bad_token_configurations_are_refused() {
        let mut tokens = Tokens::none();
        assert!(tokens.add(Scope::Read, "short", "tiny").is_err());
        assert!(tokens.add(Scope::Read, " ", SECRET).is_err());
        assert!(tokens.add_pairs(Scope::Read, "no-equals-sign").is_err());
        assert!(tokens.add_file(&format!("owner alice={SECRET}")).is_err());
        tokens.add(Scope::Read, "a", SECRET).expect("valid");
        assert!(tokens.add(Scope::Admin, "a", ADMIN_SECRET).is_err());
        assert!(
            tokens.add(Scope::Admin, "b", SECRET).is_err(),
            "same secret"
        );
    }

    #[test]
    fn secrets_under_128_bits_are_refused() {
        let mut tokens = Tokens::none();
        for weak in [
            "0123456789abcdef0123456789abcde",      // 31 hex digits: 124 bits
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", // long, one symbol
            "abcabcabcabcabcabcabcabcabcabcabcabc", // long, three symbols
            "correcthorsebatterystaple",            // 25 lowercase letters: 118 bits
            "0123456789012345678901",               // 22 digits: 73 bits
        ] {
            let e = tokens.add(Scope::Read, "weak", weak).expect_err(weak);
            assert!(
                e.to_string().contains("bits") || e.to_string().contains("shorter"),
                "{e}"
            );
        }
        tokens
            .add(Scope::Read, "hex", "00112233445566778899aabbccddeeff")
            .expect("32 hex digits: 128 bits");
        tokens
            .add(Scope::Read, "b64", SECRET)
            .expect("22 base64 characters");
        assert!(secret_bits(ADMIN_SECRET) >= MIN_SECRET_BITS);
    }

    #[test]
    fn scopes_parse_and_include_the_ones_before() {
        assert_eq!(
            Scope::parse("read:payload").expect("scope"),
            Scope::ReadPayload
        );
        assert!(Scope::parse("payload").is_err());
        assert!(Scope::Read < Scope::ReadPayload && Scope::ReadPayload < Scope::Admin);
        assert_eq!(Scope::ReadPayload.to_string(), "read:payload");
    }

    #[test]
    fn without_tokens_only_loopback_may_be_bound() {
        let open = Tokens::none();
        assert!(
            open.check_bind("127.0.0.1:9464".parse().expect("addr"))
                .is_ok()
        );
        assert!(open.check_bind("[::1]:9464".parse().expect("addr")).is_ok());
        let e = open
            .check_bind("0.0.0.0:9464".parse().expect("addr"))
            .expect_err("refused");
        assert!(e.to_string().contains("without tokens"), "{e}");
        let mut tokens = Tokens::none();
        tokens.add(Scope::Read, "a", SECRET).expect("valid");
        assert!(
            tokens
                .check_bind("0.0.0.0:9464".parse().expect("addr"))
                .is_ok()
        );
    }
}
