//! Strict parsing of the contract's request headers.
//!
//! `X-Fencing-Token` is ASCII decimal, `1..=i64::MAX`, and nothing else: no sign, no leading or
//! trailing space, no exponent, no hex, no leading zeros. A token that is coerced rather than
//! refused (`" 5"` read as 5, an overflow read as 0) is a client defect the fence can no longer see.

use http::HeaderMap;

use crate::error::{ApiError, FieldError};

pub const FENCING_TOKEN: &str = "x-fencing-token";
/// The lock server's proof of the token (docs/design.md#d-8, [`crate::proof`]):
/// `<key-id>.<hex mac>`.
pub const FENCING_PROOF: &str = "x-fencing-proof";
pub const OWNER_ID: &str = "x-owner-id";
pub const IDEMPOTENCY_KEY: &str = "x-idempotency-key";
pub const TRACEPARENT: &str = "traceparent";
/// Marks an answer the payment resource sent from a stored idempotency record: the first
/// answer's status and body, byte for byte (docs/contract.md#idempotency-rules). Its value is
/// `true`.
pub const IDEMPOTENT_REPLAY: &str = "x-idempotent-replay";

/// The longest owner id the contract allows.
pub const OWNER_ID_LEN_MAX: usize = 64;
/// What an owner id may hold as a header value: visible ASCII and the space (a header carries no
/// other character, and [`check_owner_id`] refuses control characters). A schema holds an
/// identity that becomes an owner id to it.
pub const OWNER_ID_PATTERN: &str = "^[ -~]*$";
/// The longest idempotency key this project accepts.
pub const IDEMPOTENCY_KEY_LEN_MAX: usize = 128;

/// Parses a fencing token the way the contract spells it. The reason says what was wrong.
pub fn parse_fencing_token(raw: &[u8]) -> Result<i64, &'static str> {
    if raw.is_empty() {
        return Err("is empty");
    }
    if !raw.iter().all(u8::is_ascii_digit) {
        return Err("is not an ASCII decimal integer");
    }
    if raw[0] == b'0' {
        return Err(if raw.len() == 1 {
            "must be greater than 0"
        } else {
            "has a leading zero"
        });
    }
    // Nineteen digits hold every int64; more cannot fit, and checked arithmetic catches the rest.
    let mut value: i64 = 0;
    for digit in raw {
        value = value
            .checked_mul(10)
            .and_then(|v| v.checked_add(i64::from(digit - b'0')))
            .ok_or("overflows int64")?;
    }
    Ok(value)
}

/// The `X-Fencing-Token` of a request, or `400 INVALID_TOKEN`.
pub fn fencing_token(headers: &HeaderMap) -> Result<i64, ApiError> {
    let mut values = headers.get_all(FENCING_TOKEN).iter();
    let Some(value) = values.next() else {
        return Err(ApiError::invalid_token("is missing"));
    };
    if values.next().is_some() {
        return Err(ApiError::invalid_token("is given more than once"));
    }
    parse_fencing_token(value.as_bytes()).map_err(ApiError::invalid_token)
}

fn single_text_header<'a>(
    headers: &'a HeaderMap,
    name: &str,
    display: &str,
) -> Result<Option<&'a str>, FieldError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(FieldError::new(display, "is given more than once"));
    }
    let text = value
        .to_str()
        .map_err(|_| FieldError::new(display, "must be visible ASCII"))?;
    Ok(Some(text))
}

/// Validates an owner id wherever it comes from (header or body).
pub fn check_owner_id(field: &str, owner: &str) -> Result<(), FieldError> {
    let chars = owner.chars().count();
    if chars == 0 || chars > OWNER_ID_LEN_MAX {
        return Err(FieldError::new(
            field,
            format!("must be 1 to {OWNER_ID_LEN_MAX} characters, got {chars}"),
        ));
    }
    if owner.chars().any(char::is_control) {
        return Err(FieldError::new(
            field,
            "must not contain control characters",
        ));
    }
    Ok(())
}

/// The optional `X-Owner-Id`: absent is `None`, present but malformed is an error.
pub fn owner_id_optional(headers: &HeaderMap) -> Result<Option<String>, FieldError> {
    let Some(text) = single_text_header(headers, OWNER_ID, "X-Owner-Id")? else {
        return Ok(None);
    };
    check_owner_id("X-Owner-Id", text)?;
    Ok(Some(text.to_owned()))
}

/// The required `X-Owner-Id` of a write.
pub fn owner_id(headers: &HeaderMap) -> Result<String, FieldError> {
    owner_id_optional(headers)?
        .ok_or_else(|| FieldError::new("X-Owner-Id", "is required on every write"))
}

/// The required `X-Idempotency-Key`: 1 to 128 visible ASCII characters.
pub fn idempotency_key(headers: &HeaderMap) -> Result<String, FieldError> {
    let field = "X-Idempotency-Key";
    let text = single_text_header(headers, IDEMPOTENCY_KEY, field)?
        .ok_or_else(|| FieldError::new(field, "is required on this write"))?;
    if text.is_empty() || text.len() > IDEMPOTENCY_KEY_LEN_MAX {
        return Err(FieldError::new(
            field,
            format!("must be 1 to {IDEMPOTENCY_KEY_LEN_MAX} characters"),
        ));
    }
    if !text.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(FieldError::new(
            field,
            "must be visible ASCII without spaces",
        ));
    }
    Ok(text.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn fencing_token_accepts_only_positive_ascii_decimal_int64() {
        assert_eq!(parse_fencing_token(b"1"), Ok(1));
        assert_eq!(parse_fencing_token(b"42"), Ok(42));
        assert_eq!(parse_fencing_token(b"9223372036854775807"), Ok(i64::MAX));
        for bad in [
            &b"0"[..],
            b"-1",
            b"+5",
            b" 5",
            b"5 ",
            b"1e3",
            b"0x10",
            b"9223372036854775808",
            b"99999999999999999999999",
            b"",
            b"007",
            b"1.0",
            "５".as_bytes(),
        ] {
            assert!(parse_fencing_token(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn absent_or_repeated_fencing_token_is_invalid_token() {
        let mut headers = HeaderMap::new();
        let missing = fencing_token(&headers).err().map(|e| e.code);
        assert_eq!(missing, Some(crate::ErrorCode::InvalidToken));
        headers.append(FENCING_TOKEN, HeaderValue::from_static("5"));
        headers.append(FENCING_TOKEN, HeaderValue::from_static("6"));
        let twice = fencing_token(&headers).err().map(|e| e.code);
        assert_eq!(twice, Some(crate::ErrorCode::InvalidToken));
    }

    #[test]
    fn owner_id_is_one_to_sixty_four_characters() {
        assert!(check_owner_id("o", "w").is_ok());
        assert!(check_owner_id("o", &"x".repeat(64)).is_ok());
        assert!(check_owner_id("o", &"x".repeat(65)).is_err());
        assert!(check_owner_id("o", "").is_err());
        assert!(check_owner_id("o", "a\tb").is_err());
    }
}

/// Property tests: the parsers accept exactly the contract's spelling and never panic.
#[cfg(test)]
mod properties {
    use super::*;
    use axum::http::HeaderValue;
    use proptest::prelude::*;

    /// The contract's spelling of a token, as a reference model: a positive int64 in plain
    /// ASCII decimal without sign or leading zero.
    fn model(raw: &[u8]) -> Option<i64> {
        let text = std::str::from_utf8(raw).ok()?;
        let canonical =
            !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) && !text.starts_with('0');
        let value: i64 = text.parse().ok()?;
        (canonical && value > 0).then_some(value)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn every_positive_int64_round_trips(n in 1..=i64::MAX) {
            prop_assert_eq!(parse_fencing_token(n.to_string().as_bytes()), Ok(n));
        }

        #[test]
        fn arbitrary_bytes_parse_exactly_as_the_model_says(raw in proptest::collection::vec(any::<u8>(), 0..24)) {
            prop_assert_eq!(parse_fencing_token(&raw).ok(), model(&raw));
        }

        #[test]
        fn near_misses_of_a_token_are_refused(
            n in 1..=i64::MAX,
            decoration in prop_oneof![
                Just("+{}"), Just("-{}"), Just("0{}"), Just(" {}"), Just("{} "),
                Just("{}.0"), Just("{}e0"), Just("0x{}"), Just("{}0000000000000000000"),
            ],
        ) {
            let text = decoration.replace("{}", &n.to_string());
            prop_assert!(parse_fencing_token(text.as_bytes()).is_err(), "{} was accepted", text);
        }

        #[test]
        fn owner_ids_are_accepted_iff_one_to_64_chars_without_controls(owner in "\\PC{0,70}|[\\x00-\\x7f]{0,70}") {
            let chars = owner.chars().count();
            let expected = (1..=OWNER_ID_LEN_MAX).contains(&chars) && !owner.chars().any(char::is_control);
            prop_assert_eq!(check_owner_id("X-Owner-Id", &owner).is_ok(), expected);
        }

        #[test]
        fn idempotency_keys_are_accepted_iff_1_to_128_visible_ascii(key in "[\\x20-\\x7e]{0,140}") {
            let mut headers = HeaderMap::new();
            if let Ok(value) = HeaderValue::from_str(&key) {
                headers.insert(IDEMPOTENCY_KEY, value);
                let expected = !key.is_empty()
                    && key.len() <= IDEMPOTENCY_KEY_LEN_MAX
                    && key.bytes().all(|b| b.is_ascii_graphic());
                prop_assert_eq!(idempotency_key(&headers).ok(), expected.then(|| key.clone()));
            }
        }
    }
}
