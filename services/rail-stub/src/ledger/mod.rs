//! The statement on disk: the JSON-lines file and its clientRef index.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use redb::{ReadableDatabase, ReadableMultimapTable, ReadableTable};

use crate::Transfer;

#[cfg(test)]
mod tests;

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
pub(crate) struct Ledger {
    pub(crate) path: PathBuf,
    append: std::fs::File,
    read: std::fs::File,
    /// The end of the last complete line.
    pub(crate) len: u64,
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
    pub(crate) fn open(path: &Path) -> anyhow::Result<Self> {
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
    pub(crate) fn first(&mut self, client_ref: &str) -> anyhow::Result<Option<Transfer>> {
        match self.offsets(client_ref)?.first() {
            Some(offset) => Ok(Some(self.transfer_at(*offset)?)),
            None => Ok(None),
        }
    }

    /// Every transfer accepted for `client_ref`, in statement order.
    pub(crate) fn all_for(&mut self, client_ref: &str) -> anyhow::Result<Vec<Transfer>> {
        self.offsets(client_ref)?
            .into_iter()
            .map(|offset| self.transfer_at(offset))
            .collect()
    }

    /// Appends a transfer to the statement file; only then is it accepted.
    pub(crate) fn accept(&mut self, transfer: Transfer) -> anyhow::Result<Transfer> {
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
