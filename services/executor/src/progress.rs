//! Progress on stderr: a live bar on a terminal, a plain line every two seconds otherwise.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

#[derive(Clone)]
pub struct Progress {
    bar: Option<ProgressBar>,
    done: Arc<AtomicU64>,
    ticker: Option<Arc<tokio::task::JoinHandle<()>>>,
}

impl Progress {
    pub fn start(enabled: bool, total: u64) -> Self {
        let done = Arc::new(AtomicU64::new(0));
        if !enabled {
            return Self {
                bar: None,
                done,
                ticker: None,
            };
        }
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(total);
            if let Ok(style) = ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} payouts settled ({per_sec})",
            ) {
                bar.set_style(style);
            }
            bar.enable_steady_tick(Duration::from_millis(200));
            return Self {
                bar: Some(bar),
                done,
                ticker: None,
            };
        }
        let counter = done.clone();
        let ticker = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                eprintln!(
                    "progress: {}/{total} payouts settled",
                    counter.load(Ordering::SeqCst)
                );
            }
        });
        Self {
            bar: None,
            done,
            ticker: Some(Arc::new(ticker)),
        }
    }

    pub fn inc(&self) {
        self.done.fetch_add(1, Ordering::SeqCst);
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
        if let Some(t) = &self.ticker {
            t.abort();
        }
    }
}
