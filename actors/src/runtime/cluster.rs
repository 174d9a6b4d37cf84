//! The coordinator's side of a cluster: this process's ractor_cluster node
//! server, the connection to each worker node (cookie-authenticated), the
//! handshake (version, base fingerprint, scenario), and a [`NodeLink`] per
//! node that the [`super::site::Sites`] call like a local site.
//!
//! A lost node is noticed when its session closes: ractor_cluster stops the
//! node's remote actors, so a call in flight (or the next one) fails at once
//! and becomes [`StepError::NodeLost`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use populora::compute::{GenRequest, Generation, TrainRow};
use populora::lora::BaseRef;
use populora::scenario::cluster::TlsSection;
use populora::scenario::Scenario;
use populora::selfplay::{Grammars, Learner, MemberId, Trained};
use ractor::{Actor, ActorRef};
use ractor_cluster::node::NodeConnectionMode;
use ractor_cluster::{
    IncomingEncryptionMode, NodeEventSubscription, NodeServer, NodeServerMessage,
};
use tokio::sync::mpsc;
use tokio_rustls::rustls::{
    self,
    pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer, ServerName},
};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::broker::Usage;
use super::engine::Engine;
use super::node::{HeartbeatMsg, NodeMsg, HEARTBEAT_GROUP, NODE_GROUP, VERSION};
use super::wire::{self, Answer, Failure, PackedLearner, Reply, Request, WireGenRequest};
use super::{ask, Died, NodeLost, StepError};

type SiteResult<T> = Result<T, StepError>;

/// Largest message a node or coordinator accepts (ractor_cluster's default is 16 MiB).
pub const MAX_FRAME_BYTES: u64 = 1 << 30;

/// How long a node has to answer the connection and the handshake.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);

/// ... and at a checkpoint, a node that was left out (a live node answers
/// in milliseconds; a frozen one must not hold up every checkpoint long).
const REJOIN_TIMEOUT: Duration = Duration::from_secs(5);

/// While a call is in flight the node's heartbeat is pinged this often ...
const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);
/// ... and a ping unanswered this long means the node is lost.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);

/// What went over a link: bytes each way, calls in flight, and the
/// node's compute time (milliseconds) as its usage reports say.
#[derive(Debug, Default)]
pub struct Traffic {
    pub sent: AtomicU64,
    pub received: AtomicU64,
    pub in_flight: AtomicU64,
    pub compute_ms: AtomicU64,
}

/// One worker node, as the coordinator calls it.
pub struct NodeLink {
    /// `host:port`, as the scenario names it.
    pub address: String,
    actor: ActorRef<NodeMsg>,
    /// Answers pings while the agent computes: a node that stops answering is lost.
    heartbeat: ActorRef<HeartbeatMsg>,
    grammars: Arc<Grammars>,
    base: BaseRef,
    pub traffic: Arc<Traffic>,
}

impl NodeLink {
    async fn call(&self, request: &Request) -> SiteResult<Reply> {
        let bytes = wire::encode(request);
        self.traffic
            .sent
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        let lost = |message: String| {
            StepError::NodeLost(NodeLost {
                node: self.address.clone(),
                message,
                step: 0,
            })
        };
        self.traffic.in_flight.fetch_add(1, Ordering::Relaxed);
        let reply = tokio::select! {
            reply = ask(&self.actor, |r| NodeMsg::Call(bytes, r)) => reply.map_err(|d| {
                format!("its connection closed with a request in flight ({})", d.message)
            }),
            why = self.silence() => Err(why),
        };
        self.traffic.in_flight.fetch_sub(1, Ordering::Relaxed);
        let reply = reply.map_err(lost)?;
        self.traffic
            .received
            .fetch_add(reply.len() as u64, Ordering::Relaxed);
        let answer: Answer = wire::decode(&reply).map_err(|e| lost(format!("{e:#}")))?;
        answer.map_err(|Failure { message, member }| match member {
            Some(name) => StepError::Died(Died::member(&name, message)),
            None => StepError::Fatal(anyhow::anyhow!("node {}: {message}", self.address)),
        })
    }

    /// Returns (why) once the node's heartbeat stops answering: a machine
    /// that is off or cut off, or a stopped process, is noticed within
    /// `HEARTBEAT_EVERY + HEARTBEAT_TIMEOUT`, not when TCP gives up.
    async fn silence(&self) -> String {
        loop {
            tokio::time::sleep(HEARTBEAT_EVERY).await;
            let ping = ask(&self.heartbeat, HeartbeatMsg::Ping);
            match tokio::time::timeout(HEARTBEAT_TIMEOUT, ping).await {
                Ok(Ok(_)) => {}
                Ok(Err(died)) => return format!("its heartbeat stopped ({})", died.message),
                Err(_) => return format!("no heartbeat within {HEARTBEAT_TIMEOUT:?}"),
            }
        }
    }

    async fn done(&self, request: &Request) -> SiteResult<()> {
        match self.call(request).await? {
            Reply::Done => Ok(()),
            _ => Err(self.unexpected()),
        }
    }

    fn unexpected(&self) -> StepError {
        StepError::Fatal(anyhow::anyhow!(
            "node {} answered with the wrong kind of reply",
            self.address
        ))
    }

    pub async fn place(&self, member: MemberId, name: &str, learner: &Learner) -> SiteResult<()> {
        let learner = PackedLearner::pack(learner, &self.base)?;
        let name = name.to_string();
        self.done(&Request::Place {
            member,
            name,
            learner,
        })
        .await
    }

    /// Best effort: a lost node has no members left to remove.
    pub async fn remove(&self, member: MemberId) {
        let _ = self.done(&Request::Remove { member }).await;
    }

    pub async fn learner(&self, member: MemberId) -> SiteResult<Learner> {
        match self.call(&Request::Learner { member }).await? {
            Reply::Learner(packed) => Ok(packed.unpack()?),
            _ => Err(self.unexpected()),
        }
    }

    pub async fn keep(&self) -> SiteResult<()> {
        self.done(&Request::Keep).await
    }

    pub async fn restore(&self) -> SiteResult<()> {
        self.done(&Request::Restore).await
    }

    pub async fn generate(&self, requests: Vec<GenRequest>) -> SiteResult<Vec<Generation>> {
        let requests = requests
            .into_iter()
            .map(|r| WireGenRequest::of(r, &self.grammars))
            .collect::<anyhow::Result<Vec<_>>>()?;
        match self.call(&Request::Generate { requests }).await? {
            Reply::Generations(out) => Ok(out.into_iter().map(Generation::from).collect()),
            _ => Err(self.unexpected()),
        }
    }

    pub async fn train(
        &self,
        step: u64,
        rows: Vec<TrainRow>,
    ) -> SiteResult<BTreeMap<MemberId, Trained>> {
        let rows = rows.into_iter().map(Into::into).collect();
        match self.call(&Request::Train { step, rows }).await? {
            Reply::Trained(out) => Ok(out),
            _ => Err(self.unexpected()),
        }
    }

    pub async fn usage(&self) -> SiteResult<Usage> {
        match self.call(&Request::Usage).await? {
            Reply::Usage(u) => {
                let ms = (u.generate_ms + u.train_ms).round() as u64;
                self.traffic.compute_ms.fetch_add(ms, Ordering::Relaxed);
                Ok(u)
            }
            _ => Err(self.unexpected()),
        }
    }
}

/// The shared secret in `path`, which must be readable by its owner only.
pub fn read_cookie(path: &Path) -> anyhow::Result<String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path)
        .with_context(|| format!("reading the cookie file {}", path.display()))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        bail!(
            "the cookie file {} has mode {mode:04o}: others can read it; `chmod 600 {}`",
            path.display(),
            path.display()
        );
    }
    let cookie = std::fs::read_to_string(path)
        .with_context(|| format!("reading the cookie file {}", path.display()))?;
    let cookie = cookie.trim().to_string();
    if cookie.is_empty() {
        bail!("the cookie file {} is empty", path.display());
    }
    Ok(cookie)
}

/// A node session's life, as the node server reports it.
#[derive(Debug)]
pub enum SessionEvent {
    /// `name`: the peer's name in the cluster.
    Ready {
        node_id: u64,
        peer: String,
        name: String,
    },
    /// Closed; `authenticated` is false when the other side refused our
    /// cookie (or we refused its).
    Closed {
        peer: String,
        name: String,
        authenticated: bool,
    },
}

/// Forwards the node server's session events to a channel.
pub struct Sessions {
    events: mpsc::UnboundedSender<SessionEvent>,
    authenticated: Mutex<BTreeSet<u64>>,
}

impl Sessions {
    pub fn new(events: mpsc::UnboundedSender<SessionEvent>) -> Sessions {
        Sessions {
            events,
            authenticated: Mutex::default(),
        }
    }
}

impl NodeEventSubscription for Sessions {
    fn node_session_opened(&self, _: ractor_cluster::node::NodeServerSessionInformation) {}

    fn node_session_authenticated(&self, ses: ractor_cluster::node::NodeServerSessionInformation) {
        self.authenticated
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(ses.node_id);
    }

    fn node_session_ready(&self, ses: ractor_cluster::node::NodeServerSessionInformation) {
        let _ = self.events.send(SessionEvent::Ready {
            node_id: ses.node_id,
            name: peer_name(&ses),
            peer: ses.peer_addr,
        });
    }

    fn node_session_disconnected(&self, ses: ractor_cluster::node::NodeServerSessionInformation) {
        let authenticated = self
            .authenticated
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ses.node_id);
        let _ = self.events.send(SessionEvent::Closed {
            name: peer_name(&ses),
            peer: ses.peer_addr,
            authenticated,
        });
    }
}

/// The peer's node name (ractor_cluster sends `name@host`).
fn peer_name(ses: &ractor_cluster::node::NodeServerSessionInformation) -> String {
    let full = ses.peer_name.as_ref().map_or("", |n| n.name.as_str());
    full.split_once('@')
        .map_or(full, |(name, _)| name)
        .to_string()
}

/// A ractor_cluster node server for this process, its events subscribed;
/// `tls` encrypts the connections it accepts.
pub async fn node_server(
    port: u16,
    listen: Option<std::net::IpAddr>,
    cookie: String,
    name: String,
    tls: Option<TlsAcceptor>,
) -> anyhow::Result<(
    ActorRef<NodeServerMessage>,
    mpsc::UnboundedReceiver<SessionEvent>,
)> {
    let hostname = listen.map_or_else(|| "localhost".to_string(), |ip| ip.to_string());
    let mut server = NodeServer::new(
        port,
        cookie,
        name,
        hostname,
        tls.map(IncomingEncryptionMode::Tls),
        Some(NodeConnectionMode::Isolated),
    )
    .with_max_inbound_frame_size(MAX_FRAME_BYTES);
    if let Some(ip) = listen {
        server = server.with_listen_addr(ip);
    }
    let (actor, _) = Actor::spawn(None, server, ())
        .await
        .map_err(|e| anyhow::anyhow!("starting the cluster node server: {e}"))?;
    let (tx, rx) = mpsc::unbounded_channel();
    actor
        .cast(NodeServerMessage::SubscribeToEvents {
            id: "populora".into(),
            subscription: Box::new(Sessions::new(tx)),
        })
        .map_err(|e| anyhow::anyhow!("subscribing to node events: {e}"))?;
    Ok((actor, rx))
}

/// The coordinator's cluster: its node server, the nodes it reached, and
/// what it needs to greet a node again (one that was down, at a checkpoint).
pub struct Cluster {
    pub links: Vec<NodeLink>,
    /// Nodes that did not join, and why (`down: ...` or `refused: ...`).
    pub down: BTreeMap<String, String>,
    server: ActorRef<NodeServerMessage>,
    events: mpsc::UnboundedReceiver<SessionEvent>,
    tls: Option<Tls>,
    hello: Request,
    grammars: Arc<Grammars>,
    base: BaseRef,
}

impl Cluster {
    /// Reach `address` (within `patience`) and greet its node: the link, or why not.
    async fn join(&mut self, address: &str, patience: Duration) -> Result<NodeLink, Reach> {
        let connect = reach(&self.server, &mut self.events, address, self.tls.as_ref());
        let (actor, heartbeat) = tokio::time::timeout(patience, connect)
            .await
            .unwrap_or_else(|_| Err(Reach::Down(format!("no answer within {patience:?}"))))?;
        let link = NodeLink {
            address: address.to_string(),
            actor,
            heartbeat,
            grammars: self.grammars.clone(),
            base: self.base.clone(),
            traffic: Arc::default(),
        };
        // No deadline: a node may first fetch and load the base; its
        // heartbeat says whether it is still there.
        match link.call(&self.hello).await {
            Ok(Reply::Hello { node }) => {
                eprintln!("node {address}: {node}, ready");
                Ok(link)
            }
            Ok(_) => Err(Reach::Refused(
                "answered the handshake with the wrong reply".into(),
            )),
            Err(StepError::NodeLost(n)) => Err(Reach::Down(n.message)),
            Err(StepError::Fatal(e)) => Err(Reach::Refused(format!("{e:#}"))),
            Err(StepError::Died(d)) => Err(Reach::Refused(d.message)),
        }
    }

    /// The first node that was left out and now joins (a full handshake),
    /// if any; the caller resumes with it.
    pub async fn rejoined(&mut self) -> Option<String> {
        for address in self.down.keys().cloned().collect::<Vec<_>>() {
            // A quick look first: a machine that is off costs a second, not
            // the connection timeout, at every checkpoint.
            if listens(&address).await && self.join(&address, REJOIN_TIMEOUT).await.is_ok() {
                return Some(address);
            }
        }
        None
    }

    /// Stop this process's node server and wait (its sessions and their
    /// remote actors go with it, before the next launch in this process).
    pub async fn shut_down(&self) {
        let _ = self
            .server
            .stop_and_wait(None, Some(Duration::from_secs(5)))
            .await;
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.server.stop(None);
    }
}

/// How a node that cannot be reached is taken.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Unreachable {
    /// An error: a fresh run starts on every node it names.
    Refuse,
    /// Journaled and left out (a resumed run after a node was lost).
    Skip,
}

/// Connect to every node of `scenario`'s `[cluster]` and greet it. With
/// `Refuse`, a node that does not join is an error naming it; with `Skip`
/// it is left out, and why is kept in `down`.
pub async fn connect(
    scenario: &Scenario,
    engine: &Engine,
    cookie: String,
    unreachable: Unreachable,
) -> anyhow::Result<Cluster> {
    let tls = match &scenario.cluster.tls {
        Some(section) => Some(Tls::connector(section)?),
        None => None,
    };
    // The coordinator only connects out: its own listener stays on loopback.
    let loopback = Some(std::net::Ipv4Addr::LOCALHOST.into());
    let (server, events) = node_server(0, loopback, cookie, coordinator_name(), None).await?;
    let mut cluster = Cluster {
        links: Vec::new(),
        down: BTreeMap::new(),
        server,
        events,
        tls,
        hello: Request::Hello {
            version: VERSION.to_string(),
            fingerprint: engine.fingerprint()?,
            scenario: scenario.to_toml(),
            coordinator: coordinator_name(),
        },
        grammars: engine.grammars.clone(),
        base: engine.base.clone(),
    };
    for address in &scenario.cluster.nodes {
        match (cluster.join(address, CONNECT_TIMEOUT).await, unreachable) {
            (Ok(link), _) => cluster.links.push(link),
            (Err(reach), Unreachable::Skip) => {
                let why = reach.to_string();
                eprintln!("node {address} is left out ({why})");
                cluster.down.insert(address.clone(), why);
            }
            (Err(Reach::Down(why)), Unreachable::Refuse) => bail!(
                "node {address} is not reachable: {why}; start it with `populora node --listen {address} --cookie-file FILE`"
            ),
            (Err(Reach::Refused(why)), Unreachable::Refuse) => bail!("node {address} {why}"),
        }
    }
    Ok(cluster)
}

/// This coordinator's name in the cluster (a node serves one at a time).
fn coordinator_name() -> String {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        format!("populora-coordinator-{}-{nanos:08x}", std::process::id())
    })
    .clone()
}

/// Whether something accepts a TCP connection at `address` within a second.
async fn listens(address: &str) -> bool {
    let connect = tokio::net::TcpStream::connect(address);
    matches!(
        tokio::time::timeout(Duration::from_secs(1), connect).await,
        Ok(Ok(_))
    )
}

/// How the coordinator encrypts its connections and checks the nodes.
struct Tls {
    connector: TlsConnector,
    server_name: ServerName<'static>,
}

impl Tls {
    fn connector(section: &TlsSection) -> anyhow::Result<Tls> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in certificates(&section.ca)? {
            roots
                .add(cert)
                .with_context(|| format!("cluster.tls.ca {}", section.ca.display()))?;
        }
        let config = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let server_name = ServerName::try_from(section.server_name.clone())
            .with_context(|| format!("cluster.tls.server_name {:?}", section.server_name))?;
        Ok(Tls {
            connector: TlsConnector::from(Arc::new(config)),
            server_name,
        })
    }
}

/// A node's TLS side: it presents `cert` (PEM chain) with its `key` (PEM).
pub fn tls_acceptor(cert: &Path, key: &Path) -> anyhow::Result<TlsAcceptor> {
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| anyhow::anyhow!("--tls-key {}: {e}", key.display()))?;
    let config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(certificates(cert)?, key)
        .with_context(|| format!("--tls-cert {}", cert.display()))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

fn certificates(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| anyhow::anyhow!("{}: not PEM certificates: {e}", path.display()))?;
    if certs.is_empty() {
        bail!("{} holds no certificate", path.display());
    }
    Ok(certs)
}

const NOT_AUTHENTICATED: &str = "refused this coordinator before it authenticated: the cookies do not match (each side must use the same cookie file), or the node expects TLS (cluster.tls)";

const TLS_REFUSED: &str = "refused the TLS handshake: start the node with --tls-cert and --tls-key of a certificate that cluster.tls.ca signed for cluster.tls.server_name";

/// Why a node did not join: it does not answer, or it answered no.
enum Reach {
    Down(String),
    Refused(String),
}

impl std::fmt::Display for Reach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reach::Down(why) => write!(f, "down: {why}"),
            Reach::Refused(why) => write!(f, "refused: {why}"),
        }
    }
}

/// Open a session to `address` and find its node agent.
async fn reach(
    server: &ActorRef<NodeServerMessage>,
    events: &mut mpsc::UnboundedReceiver<SessionEvent>,
    address: &str,
    tls: Option<&Tls>,
) -> Result<(ActorRef<NodeMsg>, ActorRef<HeartbeatMsg>), Reach> {
    use ractor_cluster::ClientConnectErr;
    let socket = tokio::net::lookup_host(address)
        .await
        .map_err(|e| Reach::Down(format!("{address} does not resolve: {e}")))?
        .next()
        .ok_or_else(|| Reach::Down(format!("{address} resolves to no address")))?;
    let connected = match tls {
        None => ractor_cluster::client_connect(server, socket).await,
        Some(tls) => {
            let name = tls.server_name.clone();
            ractor_cluster::client_connect_enc(server, socket, tls.connector.clone(), name).await
        }
    };
    connected.map_err(|e| match e {
        ClientConnectErr::Socket(e) => Reach::Down(e.to_string()),
        ClientConnectErr::Encryption(e) => Reach::Refused(format!("{TLS_REFUSED} ({e})")),
        other => Reach::Down(other.to_string()),
    })?;
    // Events of other sessions (a node that answered late) are not this one's.
    let peer = socket.to_string();
    let node_id = loop {
        match events.recv().await {
            Some(SessionEvent::Ready {
                node_id, peer: p, ..
            }) if p == peer => break node_id,
            Some(SessionEvent::Closed {
                authenticated: false,
                peer: p,
                ..
            }) if p == peer => return Err(Reach::Refused(NOT_AUTHENTICATED.into())),
            Some(SessionEvent::Closed { peer: p, .. }) if p == peer => {
                return Err(Reach::Down("closed the connection".into()))
            }
            Some(_) => {}
            None => return Err(Reach::Down("the node server stopped".into())),
        }
    };
    loop {
        let on_node = |group: &str| {
            ractor::pg::get_members(&group.to_string())
                .into_iter()
                .find(|cell| cell.get_id().node() == node_id)
        };
        if let (Some(agent), Some(heartbeat)) = (on_node(NODE_GROUP), on_node(HEARTBEAT_GROUP)) {
            return Ok((agent.into(), heartbeat.into()));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
