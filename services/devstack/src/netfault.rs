//! Network partitions for the fault tests: a network namespace joined to the host by a veth
//! pair, services run inside it with `ip netns exec`, and nftables drop rules (inside the
//! namespace, so parallel tests never touch each other's rules) that cut it from one peer.
//!
//! Drop, not reject: the service sees no RST and no ICMP, only silence, so its connections hang
//! the way they do when a real network partitions — the nasty case.
//!
//! Every namespace gets its own /30 out of 10.77.0.0/16 (the host end `.1`, the namespace end
//! `.2`) and a name `dlf{index}`. An index is reserved by creating an owner file (holding the pid)
//! in `/run/dlock-netfault` with `O_EXCL`; a namespace whose owner is dead is a leftover of a killed
//! run and is removed by whoever comes next. Needs root, `ip` (iproute2) and `nft` (nftables).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context, Result, anyhow, bail};
use nix::sys::signal::kill;
use nix::unistd::Pid;

/// The nftables table every partition rule lives in (one per namespace).
pub const TABLE: &str = "dlockfault";

const OWNERS: &str = "/run/dlock-netfault";
/// 10.77.0.0/16 in /30s; index 0 is never used.
const SLOTS: u32 = 16_384;

/// Fails, saying what to install or how to run, unless this process can build partitions.
pub fn require() -> Result<()> {
    let root = std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false);
    let mut missing = Vec::new();
    if !root {
        missing.push("root (network namespaces and nftables need CAP_NET_ADMIN; run as root)");
    }
    if !on_path("ip") {
        missing.push("`ip` (apt-get install iproute2)");
    }
    if !on_path("nft") {
        missing.push("`nft` (apt-get install nftables)");
    }
    if missing.is_empty() {
        Ok(())
    } else {
        bail!(
            "the netfault tests need {}; they do not skip",
            missing.join(", ")
        )
    }
}

fn on_path(program: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .any(|dir| dir.join(program).is_file())
}

fn run(program: &str, args: &[&str]) -> Result<String> {
    run_input(program, args, None)
}

fn run_input(program: &str, args: &[&str], input: Option<&str>) -> Result<String> {
    let mut command = Command::new(program);
    command.args(args);
    crate::run_output(command, &format!("{program} {}", args.join(" ")), input)
}

fn owner_file(index: u32) -> PathBuf {
    Path::new(OWNERS).join(format!("dlf{index}"))
}

fn alive(pid: i32) -> bool {
    pid > 0 && kill(Pid::from_raw(pid), None).is_ok()
}

fn remove_links(index: u32) {
    let name = format!("dlf{index}");
    let _ = run("ip", &["netns", "del", &name]);
    let _ = run("ip", &["link", "del", &format!("dlfh{index}")]);
}

/// Removes the namespaces of dead owners (a killed run's leftovers). Each is claimed by renaming
/// its owner file first, so two sweepers never clean one up twice.
pub fn sweep_leftovers() {
    let Ok(entries) = std::fs::read_dir(OWNERS) else {
        return;
    };
    for entry in entries.filter_map(|e| e.ok()) {
        let file = entry.file_name().to_string_lossy().into_owned();
        let Some(index) = file.strip_prefix("dlf").and_then(|i| i.parse::<u32>().ok()) else {
            continue;
        };
        let pid: i32 = std::fs::read_to_string(entry.path())
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        if pid == 0 || alive(pid) {
            // An owner that has not written its pid yet, or one that is running.
            continue;
        }
        let claimed = Path::new(OWNERS).join(format!(".sweep-{file}-{}", std::process::id()));
        if std::fs::rename(entry.path(), &claimed).is_ok() {
            remove_links(index);
            let _ = std::fs::remove_file(&claimed);
        }
    }
}

/// One nftables drop partition in force.
#[derive(Debug, Clone)]
pub struct Partition {
    pub peer: SocketAddr,
}

/// A network namespace with a veth pair to the host; deleted (with its rules) on drop.
pub struct NetNs {
    pub name: String,
    /// The host's end of the veth pair: where the namespace reaches host services.
    pub host_ip: Ipv4Addr,
    /// The namespace's end: where the host reaches services inside it.
    pub ns_ip: Ipv4Addr,
    index: u32,
    partitions: Mutex<Vec<Partition>>,
    injected: AtomicUsize,
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

impl NetNs {
    /// Creates a fresh namespace (name and subnet unique across processes).
    pub fn create() -> Result<Self> {
        require()?;
        std::fs::create_dir_all(OWNERS).with_context(|| format!("creating {OWNERS}"))?;
        sweep_leftovers();
        let start = (std::process::id() as usize * 131 + NEXT.fetch_add(1, Ordering::SeqCst) * 7)
            as u32
            % (SLOTS - 1);
        for step in 0..SLOTS - 1 {
            let index = 1 + (start + step) % (SLOTS - 1);
            let reserved = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(owner_file(index));
            let Ok(mut file) = reserved else {
                continue;
            };
            use std::io::Write;
            file.write_all(std::process::id().to_string().as_bytes())?;
            drop(file);
            let base = index * 4;
            let (hi, lo) = ((base >> 8) as u8, (base & 0xff) as u8);
            let mut ns = Self {
                name: format!("dlf{index}"),
                host_ip: Ipv4Addr::new(10, 77, hi, lo + 1),
                ns_ip: Ipv4Addr::new(10, 77, hi, lo + 2),
                index,
                partitions: Mutex::new(Vec::new()),
                injected: AtomicUsize::new(0),
            };
            // Whatever holds this index now is a leftover: the reservation is ours.
            remove_links(index);
            match ns.build() {
                Ok(()) => return Ok(ns),
                Err(e) => {
                    ns.teardown();
                    return Err(e);
                }
            }
        }
        bail!("no free netfault slot in 10.77.0.0/16")
    }

    fn build(&mut self) -> Result<()> {
        let host = format!("dlfh{}", self.index);
        let inner = format!("dlfn{}", self.index);
        run("ip", &["netns", "add", &self.name])?;
        run(
            "ip",
            &[
                "link", "add", &host, "type", "veth", "peer", "name", &inner, "netns", &self.name,
            ],
        )?;
        run(
            "ip",
            &["addr", "add", &format!("{}/30", self.host_ip), "dev", &host],
        )?;
        run("ip", &["link", "set", &host, "up"])?;
        let n = self.name.as_str();
        run(
            "ip",
            &[
                "-n",
                n,
                "addr",
                "add",
                &format!("{}/30", self.ns_ip),
                "dev",
                &inner,
            ],
        )?;
        run("ip", &["-n", n, "link", "set", &inner, "up"])?;
        run("ip", &["-n", n, "link", "set", "lo", "up"])?;
        Ok(())
    }

    fn teardown(&self) {
        remove_links(self.index);
        let _ = std::fs::remove_file(owner_file(self.index));
    }

    /// The host's end, as an address for services on the host that the namespace must reach.
    pub fn host_addr(&self) -> IpAddr {
        IpAddr::V4(self.host_ip)
    }

    pub fn ns_addr(&self) -> IpAddr {
        IpAddr::V4(self.ns_ip)
    }

    /// `program` as a command that runs inside the namespace (`ip netns exec` execs it, so the
    /// child's pid is the program's own).
    pub fn command(&self, program: &Path) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.name]).arg(program);
        command
    }

    fn nft(&self, script: &str) -> Result<String> {
        run_input(
            "ip",
            &["netns", "exec", &self.name, "nft", "-f", "-"],
            Some(script),
        )
    }

    /// Cuts the namespace from `peer`: every TCP packet to it and from it is dropped, both
    /// directions, established connections included. Cumulative until [`NetNs::heal`].
    pub fn partition(&self, peer: SocketAddr) -> Result<()> {
        let ip = match peer.ip() {
            IpAddr::V4(ip) => ip,
            IpAddr::V6(_) => return Err(anyhow!("netfault partitions are IPv4 only")),
        };
        let port = peer.port();
        self.nft(&format!(
            "add table inet {TABLE}\n\
             add chain inet {TABLE} out {{ type filter hook output priority -10; policy accept; }}\n\
             add chain inet {TABLE} in {{ type filter hook input priority -10; policy accept; }}\n\
             add rule inet {TABLE} out ip daddr {ip} tcp dport {port} counter drop\n\
             add rule inet {TABLE} in ip saddr {ip} tcp sport {port} counter drop\n"
        ))
        .with_context(|| format!("partitioning {} from {peer}", self.name))?;
        self.partitions
            .lock()
            .map_err(|_| anyhow!("poisoned"))?
            .push(Partition { peer });
        self.injected.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// Packets the partition rules have dropped so far (0 when healed).
    pub fn dropped_packets(&self) -> u64 {
        let Ok(text) = run(
            "ip",
            &[
                "netns", "exec", &self.name, "nft", "list", "table", "inet", TABLE,
            ],
        ) else {
            return 0;
        };
        text.split_whitespace()
            .collect::<Vec<_>>()
            .windows(2)
            .filter(|w| w[0] == "packets")
            .filter_map(|w| w[1].parse::<u64>().ok())
            .sum()
    }

    /// Deletes every partition rule (the whole table): packets flow again, and connections that
    /// survived the silence resume with their next retransmission.
    pub fn heal(&self) -> Result<()> {
        let mut partitions = self.partitions.lock().map_err(|_| anyhow!("poisoned"))?;
        if partitions.is_empty() {
            return Ok(());
        }
        self.nft(&format!("delete table inet {TABLE}\n"))
            .with_context(|| format!("healing {}", self.name))?;
        partitions.clear();
        Ok(())
    }

    /// Whether any partition is in force.
    pub fn partitioned(&self) -> bool {
        self.partitions
            .lock()
            .map(|p| !p.is_empty())
            .unwrap_or(false)
    }

    /// How many partitions were applied over this namespace's life.
    pub fn faults_injected(&self) -> usize {
        self.injected.load(Ordering::SeqCst)
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = self.heal();
        self.teardown();
    }
}
