//! `populora node --listen ADDR --cookie-file F [--model PATH]`: a worker
//! node. It waits for a coordinator (`populora run` of a scenario whose
//! `[cluster] nodes` names this address), then hosts the members placed on
//! it: its own broker on its own copy of the base, their adapters and
//! optimizer states. It serves one run at a time, and the next run that
//! greets it afterwards. Stop it with Ctrl-C.

use std::collections::BTreeMap;
use std::net::ToSocketAddrs;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use clap::Parser;
use ractor::Actor;

use crate::runtime::cluster::{node_server, read_cookie, tls_acceptor, SessionEvent};
use crate::runtime::node::{Heartbeat, NodeAgent, NodeArgs, HEARTBEAT_GROUP, NODE_GROUP, VERSION};

#[derive(Parser)]
pub struct Args {
    /// Where to listen, host:port (`0.0.0.0:7001` for every interface).
    #[arg(long)]
    pub listen: String,
    /// The cluster's shared secret: a file only its owner can read (mode
    /// 0600); the coordinator's `cluster.cookie_file` must hold the same.
    #[arg(long)]
    pub cookie_file: PathBuf,
    /// Load this base (a .gguf file or HF model directory) instead of the
    /// scenario's; its fingerprint must still match the coordinator's.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Accept TLS connections only, presenting this certificate chain (PEM),
    /// signed by the CA of the coordinator's `cluster.tls.ca`.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let cookie = read_cookie(&args.cookie_file)?;
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(tls_acceptor(cert, key)?),
        _ => None,
    };
    let secure = if tls.is_some() { " (TLS)" } else { "" };
    let addr = args
        .listen
        .to_socket_addrs()
        .with_context(|| format!("--listen {}: not a host:port", args.listen))?
        .next()
        .with_context(|| format!("--listen {}: resolves to no address", args.listen))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        // Unique in the cluster: ractor_cluster keeps one session per peer
        // name, and every machine may listen on the same 0.0.0.0:PORT.
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let name = format!("populora-node-{}-{addr}-{}", host.trim(), std::process::id());
        let (_server, mut events) =
            node_server(addr.port(), Some(addr.ip()), cookie, name, tls).await?;
        let connected = Arc::new(Mutex::new(BTreeMap::new()));
        let node_args = NodeArgs {
            model: args.model,
            connected: connected.clone(),
        };
        let started = |e: ractor::SpawnErr| anyhow::anyhow!("starting the node: {e}");
        let (agent, _) = Actor::spawn(None, NodeAgent, node_args).await.map_err(started)?;
        let (heartbeat, _) = Actor::spawn(None, Heartbeat, ()).await.map_err(started)?;
        ractor::pg::join(NODE_GROUP.to_string(), vec![agent.get_cell()]);
        ractor::pg::join(HEARTBEAT_GROUP.to_string(), vec![heartbeat.get_cell()]);
        println!("populora {VERSION} node listening on {addr}{secure}");
        while let Some(event) = events.recv().await {
            let mut connected = connected.lock().unwrap_or_else(|p| p.into_inner());
            match event {
                SessionEvent::Ready { peer, name, .. } => {
                    eprintln!("node: {peer} connected");
                    *connected.entry(name).or_insert(0) += 1;
                }
                SessionEvent::Closed {
                    peer,
                    authenticated: false,
                    ..
                } => eprintln!(
                    "node: refused {peer}: it did not authenticate (a cookie other than this node's --cookie-file, or not a populora coordinator)"
                ),
                SessionEvent::Closed { peer, name, .. } => {
                    eprintln!("node: {peer} disconnected");
                    if let Some(sessions) = connected.get_mut(&name) {
                        *sessions -= 1;
                        if *sessions == 0 {
                            connected.remove(&name);
                        }
                    }
                }
            }
        }
        Ok(())
    })
}
