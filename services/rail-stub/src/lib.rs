//! The rail stub (C3 §3.6): a stand-in for a payment rail we cannot change.
//!
//! It knows nothing of locks, tokens, sessions or fences, and it is deliberately not idempotent:
//! every accepted call is a transfer, and a repeated `clientRef` may be accepted again under a
//! new reference. Every safety property of dlock must hold with this stub treated as a hostile,
//! memoryless black box; making it idempotent would prove nothing.
//!
//! What it has accepted is its statement (`GET /statement`), which survives a restart: each
//! accepted transfer is appended to a file before the stub answers. The statement stays on
//! disk: lookups by clientRef go through an index file beside it (redb, bounded cache) and the
//! whole statement is streamed from the file, so memory does not grow with the transfers.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::Utc;
use dlock_contract::config::{ConfigError, RawConfig};
use dlock_contract::error::{ApiError, ErrorCode};
use dlock_contract::http::{HttpLimits, json_response};
use dlock_contract::json::Json;
use rand::Rng;
use redb::{ReadableDatabase, ReadableMultimapTable, ReadableTable};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::Mutex;

#[derive(Debug, Clone)]
pub struct RailStubConfig {
    pub listen: SocketAddr,
    /// `rail.stub.latency-ms`: fixed delay before every answer.
    pub latency_ms: u64,
    /// `rail.stub.latency-jitter-ms`: a uniform extra delay of up to this much.
    pub latency_jitter_ms: u64,
    /// `rail.stub.failure-rate`: share of calls that fail, half as a 5xx before acceptance and
    /// half as a connection held open and dropped (after the transfer was accepted half the time).
    pub failure_rate: f64,
    /// `rail.stub.duplicate-ack-rate`: share of repeated clientRefs accepted again as a new transfer.
    pub duplicate_ack_rate: f64,
    /// `rail.stub.decline-rate`: share of calls declined with 402.
    pub decline_rate: f64,
    /// `rail.stub.hang-ms`: how long a dropped connection is held open first.
    pub hang_ms: u64,
    /// `rail.stub.redirect-rate`: share of calls that take the transfer and then answer
    /// `307 Temporary Redirect` back to `/submit`, as a gateway in front of a rail may. A client
    /// that follows it presents the same transfer again.
    pub redirect_rate: f64,
    /// `rail.stub.statement-path`: the durable statement (JSON lines).
    pub statement_path: PathBuf,
    /// `server.tls.*`: TLS on the listener when set.
    pub tls: Option<dlock_contract::tls::TlsSettings>,
    /// `auth.*`: who may submit (the rail proxy's identity).
    pub auth: dlock_contract::auth::Authenticator,
}

impl RailStubConfig {
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        let mut raw = RawConfig::load(file)?;
        let config = Self::from_raw(&mut raw)?;
        raw.finish()?;
        Ok(config)
    }

    pub fn from_raw(raw: &mut RawConfig) -> Result<Self, ConfigError> {
        let listen_text = raw.string("server.listen", "127.0.0.1:7090")?;
        let listen = listen_text.parse().map_err(|e| ConfigError {
            key: "server.listen".into(),
            origin: String::new(),
            message: format!("must be an address like 127.0.0.1:7090, got {listen_text:?}: {e}"),
        })?;
        Ok(Self {
            listen,
            latency_ms: raw.integer("rail.stub.latency-ms", 0, 0..=600_000)? as u64,
            latency_jitter_ms: raw.integer("rail.stub.latency-jitter-ms", 0, 0..=600_000)? as u64,
            failure_rate: raw.decimal("rail.stub.failure-rate", 0.0, 0.0..=1.0)?,
            duplicate_ack_rate: raw.decimal("rail.stub.duplicate-ack-rate", 0.0, 0.0..=1.0)?,
            decline_rate: raw.decimal("rail.stub.decline-rate", 0.0, 0.0..=1.0)?,
            hang_ms: raw.integer("rail.stub.hang-ms", 30_000, 0..=600_000)? as u64,
            redirect_rate: raw.decimal("rail.stub.redirect-rate", 0.0, 0.0..=1.0)?,
            statement_path: PathBuf::from(
                raw.string("rail.stub.statement-path", "rail-statement.jsonl")?,
            ),
            tls: dlock_contract::tls::TlsSettings::from_raw(raw)?,
            auth: dlock_contract::auth::Authenticator::new(
                &dlock_contract::auth::AuthSettings::from_raw(raw)?,
                None,
                dlock_contract::auth::OperatorWithoutAuth::Refused,
            )?,
        })
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SubmitRequest {
    pub client_ref: String,
    pub amount_minor: i64,
    pub currency: String,
}

pub use dlock_contract::rail::{Statement, Transfer};

/// How much memory the statement index may use for its page cache; everything else of the
/// statement stays on disk, so the stub's memory does not grow with the number of transfers.
pub const INDEX_CACHE_BYTES: usize = 1 << 20;
/// Index commits are not fsynced (the statement file is the truth and the index catches up from
/// it after a kill); every this many, one is, so the index file reuses its freed pages.
const DURABLE_EVERY: u64 = 1_024;
/// Statement lines indexed per transaction when the index catches up with the file.
const CATCH_UP_BATCH: usize = 10_000;

/// clientRef -> the byte offset of each of its lines in the statement, in statement order.
const BY_REF: redb::MultimapTableDefinition<&str, u64> =
    redb::MultimapTableDefinition::new("by_client_ref");
/// `indexed_to`: the statement is indexed up to this byte; `last_line`: the offset of the last
/// line indexed, which must still be that line for the index to be trusted on open.
const META: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("meta");

/// The statement: a JSON-lines file (the truth, one write(2) per accepted transfer) and an index
/// beside it (`<statement>.index`, redb) from clientRef to line offsets. The index is derived
/// data: it is rebuilt from the file when missing, unreadable or not the file's (an older
/// version's statement is indexed on its first start), and after a kill it catches up from the
/// last offset it had committed.
struct Ledger {
    path: PathBuf,
    append: std::fs::File,
    read: std::fs::File,
    /// The end of the last complete line.
    len: u64,
    index: redb::Database,
    indexed_to: u64,
    commits: u64,
}

fn index_path(statement: &Path) -> PathBuf {
    let mut name = statement.as_os_str().to_owned();
    name.push(".index");
    PathBuf::from(name)
}

/// The line that starts at `offset`, without its newline; `None` past the end of `len`.
fn line_at(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<Option<Vec<u8>>> {
    use std::os::unix::fs::FileExt;
    let mut line = Vec::new();
    let mut at = offset;
    let mut chunk = [0u8; 512];
    while at < len {
        let want = usize::try_from((len - at).min(chunk.len() as u64)).unwrap_or(chunk.len());
        let n = file.read_at(&mut chunk[..want], at)?;
        if n == 0 {
            break;
        }
        if let Some(end) = chunk[..n].iter().position(|b| *b == b'\n') {
            line.extend_from_slice(&chunk[..end]);
            return Ok(Some(line));
        }
        line.extend_from_slice(&chunk[..n]);
        at += n as u64;
    }
    Ok(None)
}

impl Ledger {
    fn open(path: &Path) -> anyhow::Result<Self> {
        let append = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening the statement {}", path.display()))?;
        let read = std::fs::File::open(path)
            .with_context(|| format!("opening the statement {}", path.display()))?;
        let len = Self::drop_torn_tail(path, &append, &read)?;
        let index = Self::open_index(&index_path(path))?;
        let mut ledger = Self {
            path: path.to_owned(),
            append,
            read,
            len,
            index,
            indexed_to: 0,
            commits: 0,
        };
        ledger.indexed_to = ledger.trusted_index_end()?;
        if ledger.indexed_to == 0 {
            ledger.clear_index()?;
        }
        let from = ledger.indexed_to;
        ledger.catch_up()?;
        if ledger.len > from {
            tracing::info!(
                event = "statement_indexed",
                from,
                to = ledger.len,
                "the statement index caught up with the statement file"
            );
        }
        Ok(ledger)
    }

    /// A line without its newline at the end of the file was torn by a crash mid-append and
    /// never acknowledged: it is cut off, so the next append starts a line of its own.
    fn drop_torn_tail(
        path: &Path,
        append: &std::fs::File,
        read: &std::fs::File,
    ) -> anyhow::Result<u64> {
        use std::os::unix::fs::FileExt;
        let size = read.metadata()?.len();
        let mut end = size;
        let mut chunk = [0u8; 4096];
        while end > 0 {
            let from = end.saturating_sub(chunk.len() as u64);
            let n = usize::try_from(end - from).unwrap_or(chunk.len());
            read.read_exact_at(&mut chunk[..n], from)?;
            match chunk[..n].iter().rposition(|b| *b == b'\n') {
                Some(i) => {
                    end = from + i as u64 + 1;
                    break;
                }
                None => end = from,
            }
        }
        if end < size {
            tracing::warn!(event = "statement_torn_tail_dropped", path = %path.display(), bytes = size - end, "an unfinished last line of the statement (never acknowledged) was cut off");
            append
                .set_len(end)
                .with_context(|| format!("cutting the torn last line of {}", path.display()))?;
        }
        Ok(end)
    }

    fn open_index(path: &Path) -> anyhow::Result<redb::Database> {
        let open = || {
            redb::Builder::new()
                .set_cache_size(INDEX_CACHE_BYTES)
                .create(path)
        };
        let db = match open() {
            Ok(db) => db,
            Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
                anyhow::bail!(
                    "the statement index {} is open in another process: one rail stub per statement",
                    path.display()
                )
            }
            Err(e) => {
                // The index is derived from the statement: an unreadable one is rebuilt.
                tracing::warn!(event = "statement_index_rebuilt", path = %path.display(), error = %e, "the statement index was unreadable and is rebuilt from the statement");
                std::fs::remove_file(path)
                    .with_context(|| format!("removing the unreadable index {}", path.display()))?;
                open().with_context(|| format!("creating the index {}", path.display()))?
            }
        };
        Ok(db)
    }

    /// How far the index on disk covers this statement file; 0 when it is not this file's.
    fn trusted_index_end(&self) -> anyhow::Result<u64> {
        let txn = self.index.begin_read()?;
        let meta = match txn.open_table(META) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(0),
            Err(e) => return Err(e.into()),
        };
        let get =
            |key: &str| -> anyhow::Result<Option<u64>> { Ok(meta.get(key)?.map(|v| v.value())) };
        let (Some(indexed_to), Some(last_line)) = (get("indexed_to")?, get("last_line")?) else {
            return Ok(0);
        };
        if indexed_to > self.len || last_line >= indexed_to {
            return Ok(0);
        }
        let Some(line) = line_at(&self.read, last_line, self.len)? else {
            return Ok(0);
        };
        let Ok(transfer) = serde_json::from_slice::<Transfer>(&line) else {
            return Ok(0);
        };
        let refs = txn.open_multimap_table(BY_REF)?;
        for offset in refs.get(transfer.client_ref.as_str())? {
            if offset?.value() == last_line {
                return Ok(indexed_to);
            }
        }
        Ok(0)
    }

    fn clear_index(&mut self) -> anyhow::Result<()> {
        let txn = self.index.begin_write()?;
        txn.delete_multimap_table(BY_REF)?;
        txn.delete_table(META)?;
        txn.open_multimap_table(BY_REF)?;
        txn.open_table(META)?;
        txn.commit()?;
        self.indexed_to = 0;
        Ok(())
    }

    fn begin(&mut self) -> anyhow::Result<redb::WriteTransaction> {
        let mut txn = self.index.begin_write()?;
        self.commits += 1;
        if !self.commits.is_multiple_of(DURABLE_EVERY) {
            txn.set_durability(redb::Durability::None)?;
        }
        Ok(txn)
    }

    /// Indexes the statement lines the index does not cover yet: all of them on a first start,
    /// the last few after a kill, none in the steady state (each accept indexes its own line).
    fn catch_up(&mut self) -> anyhow::Result<()> {
        use std::io::{BufRead, Read, Seek, SeekFrom};
        if self.indexed_to >= self.len {
            return Ok(());
        }
        let mut file = std::fs::File::open(&self.path)?;
        file.seek(SeekFrom::Start(self.indexed_to))?;
        let mut reader = std::io::BufReader::new(file).take(self.len - self.indexed_to);
        let mut line = Vec::new();
        let mut at = self.indexed_to;
        loop {
            let txn = self.begin()?;
            let mut lines = 0;
            {
                let mut refs = txn.open_multimap_table(BY_REF)?;
                let mut meta = txn.open_table(META)?;
                while lines < CATCH_UP_BATCH {
                    line.clear();
                    let n = reader.read_until(b'\n', &mut line)?;
                    if n == 0 {
                        break;
                    }
                    lines += 1;
                    let text = line.strip_suffix(b"\n").unwrap_or(&line);
                    match serde_json::from_slice::<Transfer>(text) {
                        Ok(t) => {
                            refs.insert(t.client_ref.as_str(), at)?;
                            meta.insert("last_line", at)?;
                        }
                        Err(e) if !text.iter().all(u8::is_ascii_whitespace) => {
                            tracing::warn!(event = "statement_line_skipped", offset = at, error = %e, "unreadable statement line skipped")
                        }
                        Err(_) => {}
                    }
                    at += n as u64;
                }
                meta.insert("indexed_to", at)?;
            }
            txn.commit()?;
            self.indexed_to = at;
            if lines < CATCH_UP_BATCH {
                return Ok(());
            }
        }
    }

    /// The offsets of `client_ref`'s lines, first accepted first.
    fn offsets(&mut self, client_ref: &str) -> anyhow::Result<Vec<u64>> {
        self.catch_up()?;
        let txn = self.index.begin_read()?;
        let refs = txn.open_multimap_table(BY_REF)?;
        let mut offsets = Vec::new();
        for offset in refs.get(client_ref)? {
            offsets.push(offset?.value());
        }
        Ok(offsets)
    }

    fn transfer_at(&self, offset: u64) -> anyhow::Result<Transfer> {
        let line = line_at(&self.read, offset, self.len)?
            .with_context(|| format!("no statement line at offset {offset}"))?;
        serde_json::from_slice(&line)
            .with_context(|| format!("the statement line at offset {offset} is unreadable"))
    }

    /// The first transfer accepted for `client_ref`, if any.
    fn first(&mut self, client_ref: &str) -> anyhow::Result<Option<Transfer>> {
        match self.offsets(client_ref)?.first() {
            Some(offset) => Ok(Some(self.transfer_at(*offset)?)),
            None => Ok(None),
        }
    }

    /// Every transfer accepted for `client_ref`, in statement order.
    fn all_for(&mut self, client_ref: &str) -> anyhow::Result<Vec<Transfer>> {
        self.offsets(client_ref)?
            .into_iter()
            .map(|offset| self.transfer_at(offset))
            .collect()
    }

    /// Appends a transfer to the statement file; only then is it accepted.
    fn accept(&mut self, transfer: Transfer) -> anyhow::Result<Transfer> {
        let mut line = serde_json::to_vec(&transfer)?;
        line.push(b'\n');
        // One write(2) of the whole line: the page cache outlives a killed stub, which is the
        // restart the statement must survive. A stand-in rail need not survive a power cut.
        if let Err(e) = self.append.write_all(&line) {
            // A partly written line was never accepted: cut it so the next line starts clean.
            let _ = self.append.set_len(self.len);
            return Err(e.into());
        }
        let at = self.len;
        self.len += line.len() as u64;
        // The transfer is accepted now. Its index entry follows; if that fails, the index
        // catches up from the file before the next lookup, so no repeat goes unseen.
        if self.indexed_to == at
            && let Err(e) = self.index_one(&transfer.client_ref, at)
        {
            tracing::warn!(event = "statement_index_behind", error = %e, "indexing an accepted transfer failed; the index catches up before the next lookup");
        }
        Ok(transfer)
    }

    fn index_one(&mut self, client_ref: &str, at: u64) -> anyhow::Result<()> {
        let txn = self.begin()?;
        {
            let mut refs = txn.open_multimap_table(BY_REF)?;
            refs.insert(client_ref, at)?;
            let mut meta = txn.open_table(META)?;
            meta.insert("last_line", at)?;
            meta.insert("indexed_to", self.len)?;
        }
        txn.commit()?;
        self.indexed_to = self.len;
        Ok(())
    }
}

#[derive(Clone)]
pub struct StubState {
    config: Arc<RailStubConfig>,
    ledger: Arc<Mutex<Ledger>>,
}

impl StubState {
    pub fn open(config: RailStubConfig) -> anyhow::Result<Self> {
        let ledger = Ledger::open(&config.statement_path)?;
        Ok(Self {
            config: Arc::new(config),
            ledger: Arc::new(Mutex::new(ledger)),
        })
    }
}

pub fn app(state: StubState) -> Router {
    let routes = Router::new()
        .route("/submit", post(submit))
        .route("/statement", get(statement))
        .route("/healthz", get(healthz))
        .route("/readyz", get(healthz))
        .route(
            dlock_contract::openapi::PATH,
            get(|| async { dlock_contract::openapi::response(&openapi::document()) }),
        )
        .with_state(state.clone());
    let routes = state.config.auth.protect(routes);
    let limits = HttpLimits {
        body_bytes_max: 16 * 1024,
        request_timeout: Duration::from_secs(3_600),
    };
    dlock_contract::http::finish(routes, limits)
}

pub async fn run(config: RailStubConfig) -> anyhow::Result<()> {
    let listen = config.listen;
    let tls = config.tls.clone();
    config.auth.announce("rail-stub");
    let state = StubState::open(config)?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen} (server.listen)"))?;
    tracing::info!(event = "rail_stub_started", listen = %listener.local_addr()?, "rail stub is serving");
    dlock_contract::http::serve_maybe_tls(
        listener,
        tls.as_ref(),
        app(state),
        dlock_contract::http::shutdown_signal(),
    )
    .await
    .context("the HTTP server failed")?;
    Ok(())
}

fn new_reference() -> String {
    format!("rail-{}", uuid::Uuid::new_v4().simple())
}

/// What the dice decided for one call, drawn before the latency so it cannot depend on timing.
enum Fate {
    Fail5xx,
    Drop { accepted: bool },
    Decline,
    Redirect,
    Accept,
}

fn draw(config: &RailStubConfig) -> Fate {
    let mut rng = rand::rng();
    if rng.random_bool(config.failure_rate) {
        if rng.random_bool(0.5) {
            Fate::Fail5xx
        } else {
            Fate::Drop {
                accepted: rng.random_bool(0.5),
            }
        }
    } else if rng.random_bool(config.decline_rate) {
        Fate::Decline
    } else if rng.random_bool(config.redirect_rate) {
        Fate::Redirect
    } else {
        Fate::Accept
    }
}

/// A real rail keeps processing a transfer whose caller hung up, so the work runs in its own
/// task: a proxy that dies mid-flight cannot cancel it.
async fn submit(
    State(state): State<StubState>,
    Json(body): Json<SubmitRequest>,
) -> Result<Response, ApiError> {
    tokio::spawn(process(state, body))
        .await
        .unwrap_or_else(|e| Err(ApiError::internal(format!("the transfer task failed: {e}"))))
}

async fn process(state: StubState, body: SubmitRequest) -> Result<Response, ApiError> {
    if body.client_ref.is_empty() || body.client_ref.len() > 128 {
        return Err(ApiError::field("clientRef", "must be 1 to 128 characters"));
    }
    if body.amount_minor <= 0 {
        return Err(ApiError::field("amountMinor", "must be greater than 0"));
    }
    if body.currency.len() != 3 || !body.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(ApiError::field("currency", "must be an ISO-4217 code"));
    }
    let config = state.config.clone();
    let fate = draw(&config);
    let jitter = if config.latency_jitter_ms > 0 {
        rand::rng().random_range(0..=config.latency_jitter_ms)
    } else {
        0
    };
    if config.latency_ms + jitter > 0 {
        tokio::time::sleep(Duration::from_millis(config.latency_ms + jitter)).await;
    }
    let transfer = |reference: String| Transfer {
        client_ref: body.client_ref.clone(),
        rail_reference: reference,
        amount_minor: body.amount_minor,
        currency: body.currency.clone(),
        accepted_at: Utc::now(),
    };
    match fate {
        Fate::Fail5xx => Ok(json_response(
            StatusCode::BAD_GATEWAY,
            &json!({"code": "RAIL_INTERNAL", "message": "the rail failed; nothing was accepted"}),
        )),
        Fate::Decline => Ok(json_response(
            StatusCode::PAYMENT_REQUIRED,
            &json!({"code": "DECLINED", "message": "the rail declined the transfer"}),
        )),
        Fate::Drop { accepted } => {
            if accepted {
                let mut ledger = state.ledger.lock().await;
                ledger
                    .accept(transfer(new_reference()))
                    .map_err(ApiError::internal)?;
            }
            // Hold the connection open, then give up on it without a proper answer.
            tokio::time::sleep(Duration::from_millis(config.hang_ms)).await;
            Ok((
                StatusCode::OK,
                [("connection", "close")],
                "{\"railRef", // a torn, malformed acknowledgement
            )
                .into_response())
        }
        Fate::Redirect => {
            let mut ledger = state.ledger.lock().await;
            ledger
                .accept(transfer(new_reference()))
                .map_err(ApiError::internal)?;
            Ok((
                StatusCode::TEMPORARY_REDIRECT,
                [("location", "/submit")],
                "",
            )
                .into_response())
        }
        Fate::Accept => {
            let mut ledger = state.ledger.lock().await;
            let repeat = ledger.first(&body.client_ref).map_err(ApiError::internal)?;
            let accepted = match repeat {
                // A repeat that the rail does not take again answers with the first reference.
                Some(first) if !rand::rng().random_bool(config.duplicate_ack_rate) => first,
                _ => ledger
                    .accept(transfer(new_reference()))
                    .map_err(ApiError::internal)?,
            };
            Ok(json_response(
                StatusCode::OK,
                &json!({
                    "railReference": accepted.rail_reference,
                    "acceptedAt": dlock_contract::time::format(&accepted.accepted_at),
                }),
            ))
        }
    }
}

async fn statement(
    State(state): State<StubState>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let mut client_ref = None;
    for pair in query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
    {
        match pair.split_once('=') {
            Some(("clientRef", v)) => client_ref = Some(v.to_owned()),
            _ => {
                return Err(ApiError::new(
                    ErrorCode::ValidationFailed,
                    "the only query parameter is clientRef",
                ));
            }
        }
    }
    match client_ref {
        Some(r) => {
            let transfers = state
                .ledger
                .lock()
                .await
                .all_for(&r)
                .map_err(ApiError::internal)?;
            Ok(Json(Statement { transfers }).into_response())
        }
        None => {
            let (path, len) = {
                let ledger = state.ledger.lock().await;
                (ledger.path.clone(), ledger.len)
            };
            stream_statement(path, len)
        }
    }
}

/// The whole statement, read from the file up to `len` (its end when asked) and sent as it is
/// read: the response has the shape of [`Statement`], and memory holds a few chunks of it.
fn stream_statement(path: PathBuf, len: u64) -> Result<Response, ApiError> {
    use std::io::BufRead;
    let file = std::fs::File::open(&path).map_err(|e| {
        ApiError::internal(format!("cannot open the statement {}: {e}", path.display()))
    })?;
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Vec<u8>>>(4);
    tokio::task::spawn_blocking(move || {
        use std::io::Read;
        const CHUNK: usize = 64 * 1024;
        let mut reader = std::io::BufReader::new(file).take(len);
        let mut out = b"{\"transfers\":[".to_vec();
        let mut first = true;
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => {
                    let _ = tx.blocking_send(Err(e));
                    return;
                }
            }
            // Each line is re-encoded from its Transfer, so the answer is exactly what the
            // statement type serializes to; unreadable lines were never accepted transfers.
            let Ok(transfer) = serde_json::from_slice::<Transfer>(line.trim_ascii_end()) else {
                continue;
            };
            if !first {
                out.push(b',');
            }
            first = false;
            if let Err(e) = serde_json::to_writer(&mut out, &transfer) {
                let _ = tx.blocking_send(Err(std::io::Error::other(e)));
                return;
            }
            if out.len() >= CHUNK && tx.blocking_send(Ok(std::mem::take(&mut out))).is_err() {
                return; // the client went away
            }
        }
        out.extend_from_slice(b"]}");
        let _ = tx.blocking_send(Ok(out));
    });
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (chunk, rx))
    });
    Ok((
        StatusCode::OK,
        [(
            axum::http::header::CONTENT_TYPE,
            dlock_contract::http::JSON_CONTENT_TYPE,
        )],
        axum::body::Body::from_stream(body),
    )
        .into_response())
}

async fn healthz() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

/// The rail stub's OpenAPI document (C3 §3.6), served at `GET /v1/openapi.json`. Each operation
/// documents the handler of the same name above.
pub mod openapi {
    #![allow(dead_code)]

    use dlock_contract::error::ErrorBody;
    use dlock_contract::rail::Statement;
    use utoipa::OpenApi;

    use super::SubmitRequest;

    #[derive(OpenApi)]
    #[openapi(
        info(
            title = "dlock rail stub",
            description = "A hostile stand-in for the payment rail: slow, lossy, non-idempotent (C3 §3.6)."
        ),
        paths(submit, statement, healthz, readyz)
    )]
    pub struct ApiDoc;

    /// The rail stub's document.
    pub fn document() -> utoipa::openapi::OpenApi {
        ApiDoc::openapi()
    }

    /// One transfer; every accepted call is a fresh transfer.
    #[utoipa::path(post, path = "/submit", request_body = SubmitRequest, responses(
        (status = 200, description = "accepted: railReference, acceptedAt", body = serde_json::Value),
        (status = 400, description = "VALIDATION_FAILED", body = ErrorBody),
        (status = 402, description = "declined (the rail's own body, not the envelope)", body = serde_json::Value),
        (status = 502, description = "the rail failed (the rail's own body, not the envelope)", body = serde_json::Value),
    ))]
    fn submit() {}

    /// The durable statement, optionally for one clientRef.
    #[utoipa::path(get, path = "/statement", params(("clientRef" = Option<String>, Query)), responses(
        (status = 200, body = Statement),
        (status = 400, description = "VALIDATION_FAILED", body = ErrorBody),
    ))]
    fn statement() {}

    /// Process up.
    #[utoipa::path(get, path = "/healthz", responses((status = 200, body = serde_json::Value)))]
    fn healthz() {}

    /// Ready.
    #[utoipa::path(get, path = "/readyz", responses((status = 200, body = serde_json::Value)))]
    fn readyz() {}
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn transfer(client_ref: &str, n: u64) -> Transfer {
        Transfer {
            client_ref: client_ref.to_owned(),
            rail_reference: format!("rail-{n}"),
            amount_minor: 100,
            currency: "EUR".into(),
            accepted_at: chrono::DateTime::from_timestamp_millis(1_700_000_000_000).unwrap(),
        }
    }

    fn line(t: &Transfer) -> String {
        format!("{}\n", serde_json::to_string(t).unwrap())
    }

    #[test]
    fn an_older_statement_without_an_index_is_indexed_on_open_and_its_torn_tail_cut() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("statement.jsonl");
        let mut text = String::new();
        for n in 0..3 {
            text += &line(&transfer(&format!("ref-{n}"), n));
        }
        text += &line(&transfer("ref-1", 9)); // a duplicate acknowledgement
        text += "{\"clientRef\":\"torn"; // a crash mid-append
        std::fs::write(&path, &text).unwrap();

        let mut ledger = Ledger::open(&path).unwrap();
        assert_eq!(
            ledger.first("ref-1").unwrap().unwrap().rail_reference,
            "rail-1"
        );
        let all: Vec<_> = ledger.all_for("ref-1").unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(all[1].rail_reference, "rail-9");
        assert!(ledger.first("torn").unwrap().is_none());
        // The next line starts on a line of its own.
        ledger.accept(transfer("ref-4", 4)).unwrap();
        drop(ledger);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.ends_with(&line(&transfer("ref-4", 4))));
        assert_eq!(text.lines().count(), 5);
        let mut ledger = Ledger::open(&path).unwrap();
        assert_eq!(
            ledger.first("ref-4").unwrap().unwrap().rail_reference,
            "rail-4"
        );
    }

    #[test]
    fn lines_the_index_missed_are_caught_up_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("statement.jsonl");
        let mut ledger = Ledger::open(&path).unwrap();
        for n in 0..5 {
            ledger.accept(transfer(&format!("ref-{n}"), n)).unwrap();
        }
        drop(ledger);
        // Lines appended behind the index's back, as after a kill between the write and the
        // index commit.
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        file.write_all(line(&transfer("ref-5", 5)).as_bytes())
            .unwrap();
        file.write_all(line(&transfer("ref-0", 6)).as_bytes())
            .unwrap();
        drop(file);
        let mut ledger = Ledger::open(&path).unwrap();
        assert_eq!(
            ledger.first("ref-5").unwrap().unwrap().rail_reference,
            "rail-5"
        );
        assert_eq!(
            ledger.first("ref-0").unwrap().unwrap().rail_reference,
            "rail-0"
        );
        assert_eq!(ledger.all_for("ref-0").unwrap().len(), 2);
    }

    #[test]
    fn an_index_of_another_statement_is_rebuilt() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("statement.jsonl");
        let mut ledger = Ledger::open(&path).unwrap();
        for n in 0..5 {
            ledger.accept(transfer(&format!("old-{n}"), n)).unwrap();
        }
        drop(ledger);
        // The statement file is replaced by a longer one the index never saw.
        let mut text = String::new();
        for n in 0..8 {
            text += &line(&transfer(&format!("new-{n}"), 100 + n));
        }
        std::fs::write(&path, text).unwrap();
        let mut ledger = Ledger::open(&path).unwrap();
        assert!(ledger.first("old-4").unwrap().is_none());
        assert_eq!(
            ledger.first("new-7").unwrap().unwrap().rail_reference,
            "rail-107"
        );
        // And a shorter one.
        drop(ledger);
        std::fs::write(&path, line(&transfer("short", 1))).unwrap();
        let mut ledger = Ledger::open(&path).unwrap();
        assert!(ledger.first("new-0").unwrap().is_none());
        assert_eq!(
            ledger.first("short").unwrap().unwrap().rail_reference,
            "rail-1"
        );
    }

    #[test]
    fn an_unreadable_index_is_rebuilt_from_the_statement() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("statement.jsonl");
        let mut ledger = Ledger::open(&path).unwrap();
        ledger.accept(transfer("ref-0", 0)).unwrap();
        drop(ledger);
        std::fs::write(index_path(&path), b"not a database").unwrap();
        let mut ledger = Ledger::open(&path).unwrap();
        assert_eq!(
            ledger.first("ref-0").unwrap().unwrap().rail_reference,
            "rail-0"
        );
    }
}
