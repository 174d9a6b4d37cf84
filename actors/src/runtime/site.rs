//! Where members live. A [`LocalSite`] is a broker and member actors in this
//! process; a node (`super::cluster::NodeLink`) is a `LocalSite` in another
//! process, reached over ractor_cluster. [`Sites`] places each member on one
//! (a pure function of the scenario and of the nodes that are up), splits
//! each phase's batch by site, runs the parts side by side and puts the
//! results back in request order.

use std::collections::BTreeMap;

use anyhow::Context;
use populora::compute::{GenRequest, Generation, TrainRow};
use populora::scenario::ClusterSection;
use populora::selfplay::{Learner, MemberId, Trained};
use ractor::{Actor, ActorCell, ActorRef};

use super::broker::{Broker, BrokerMsg, Usage};
use super::cluster::{Cluster, NodeLink};
use super::control::NodeStatus;
use super::engine::Engine;
use super::member::{self, Member, MemberArgs, MemberMsg};
use super::{ask, Died, StepError};

type SiteResult<T> = Result<T, StepError>;

/// A broker and its members in this process.
pub struct LocalSite {
    supervisor: ActorCell,
    broker: ActorRef<BrokerMsg>,
    members: BTreeMap<MemberId, (String, ActorRef<MemberMsg>)>,
    /// Every member's state at the start of the step, for a retry.
    kept: BTreeMap<MemberId, (String, Learner)>,
    grad_clip: f64,
}

impl LocalSite {
    /// A broker on `engine`'s base, linked to `supervisor` (as the members will be).
    pub async fn start(engine: &Engine, supervisor: ActorCell) -> anyhow::Result<LocalSite> {
        let args = (engine.model.clone(), engine.settings.train);
        let (broker, _) = Actor::spawn_linked(None, Broker, args, supervisor.clone())
            .await
            .context("starting the broker")?;
        Ok(LocalSite {
            supervisor,
            broker,
            members: BTreeMap::new(),
            kept: BTreeMap::new(),
            grad_clip: engine.settings.grad_clip,
        })
    }

    pub async fn place(
        &mut self,
        id: MemberId,
        name: &str,
        learner: Learner,
    ) -> anyhow::Result<()> {
        let adapter = learner.adapter.clone();
        let args = MemberArgs {
            name: name.to_string(),
            learner,
            grad_clip: self.grad_clip,
        };
        let (actor, _) = Actor::spawn_linked(None, Member, args, self.supervisor.clone())
            .await
            .context("starting a member")?;
        self.members.insert(id, (name.to_string(), actor));
        self.broker
            .cast(BrokerMsg::Join {
                member: id,
                adapter,
            })
            .context("the broker is not running")
    }

    pub fn remove(&mut self, id: MemberId) {
        if let Some((_, actor)) = self.members.remove(&id) {
            actor.stop(None);
        }
        let _ = self.broker.cast(BrokerMsg::Leave { member: id });
    }

    pub async fn generate(&self, requests: Vec<GenRequest>) -> SiteResult<Vec<Generation>> {
        Ok(ask(&self.broker, |reply| BrokerMsg::Generate {
            requests,
            reply,
        })
        .await??)
    }

    /// The train step's gradients, then every member's update (concurrently);
    /// results keyed by member, so arrival order never matters.
    pub async fn train(
        &self,
        step: u64,
        rows: Vec<TrainRow>,
    ) -> SiteResult<BTreeMap<MemberId, Trained>> {
        let out = ask(&self.broker, |reply| BrokerMsg::Train { rows, reply }).await??;
        let mut pending = tokio::task::JoinSet::new();
        for (id, grads) in out.grads {
            let (name, actor) = self.members.get(&id).cloned().ok_or_else(|| {
                StepError::Fatal(anyhow::anyhow!("member {id} has rows but no actor here"))
            })?;
            let (tx, rx) = tokio::sync::oneshot::channel();
            actor
                .send_message(MemberMsg::Update {
                    step,
                    grads,
                    reply: tx.into(),
                })
                .map_err(|_| Died::member(&name, format!("{name} is not running")))?;
            pending.spawn(async move { (id, name, rx.await) });
        }
        let mut trained = BTreeMap::new();
        while let Some(joined) = pending.join_next().await {
            let (id, name, result) = joined.map_err(|e| StepError::Fatal(e.into()))?;
            let updated = match result {
                Ok(Ok(updated)) => updated,
                Ok(Err(e)) => return Err(StepError::Fatal(e.context(format!("{name}'s update")))),
                Err(_) => {
                    let died = Died::member(&name, format!("{name} died in step {step}'s update"));
                    return Err(StepError::Died(died));
                }
            };
            let stats = out.stats.get(&id).cloned().unwrap_or_default();
            let t = Trained {
                tokens: stats.tokens,
                tokens_run: stats.tokens_run,
                grad_norm: updated.grad_norm,
                checksum: updated.checksum,
            };
            trained.insert(id, t);
        }
        Ok(trained)
    }

    /// A deep copy of member `id`'s adapter and optimizer.
    pub async fn learner(&self, id: MemberId) -> SiteResult<Learner> {
        let (name, actor) = self
            .members
            .get(&id)
            .ok_or_else(|| StepError::Fatal(anyhow::anyhow!("member {id} is not here")))?;
        Ok(ask(actor, |reply| MemberMsg::Snapshot { reply })
            .await
            .map_err(|d| d.of_member(name))??)
    }

    pub async fn keep(&mut self) -> SiteResult<()> {
        let mut kept = BTreeMap::new();
        for (&id, (name, _)) in &self.members {
            kept.insert(id, (name.clone(), self.learner(id).await?));
        }
        self.kept = kept;
        Ok(())
    }

    /// Stop every member and start the kept ones again.
    pub async fn restore(&mut self) -> anyhow::Result<()> {
        for (id, (_, actor)) in std::mem::take(&mut self.members) {
            actor.stop(None);
            let _ = self.broker.cast(BrokerMsg::Leave { member: id });
        }
        let kept = std::mem::take(&mut self.kept);
        for (&id, (name, learner)) in &kept {
            self.place(id, name, member::snapshot(learner)?).await?;
        }
        self.kept = kept;
        Ok(())
    }

    pub async fn usage(&self) -> SiteResult<Usage> {
        Ok(ask(&self.broker, |reply| BrokerMsg::Usage { reply }).await?)
    }

    /// Stop every member and the broker.
    pub fn stop(mut self) {
        for id in self.members.keys().copied().collect::<Vec<_>>() {
            self.remove(id);
        }
        self.broker.stop(None);
    }
}

/// A place members run: this process or a worker node.
pub enum Site {
    Local(LocalSite),
    Node(NodeLink),
}

/// Every site of a run and which member lives on which.
pub struct Sites {
    sites: Vec<Site>,
    home: BTreeMap<MemberId, usize>,
    /// `home` at the start of the step, for a retry.
    kept_home: BTreeMap<MemberId, usize>,
    cluster: ClusterSection,
    /// The nodes that are up, in the order of `sites` (empty: one local site).
    live: Vec<String>,
    /// The node server (kept alive while the sites are) and the nodes that are down.
    cluster_state: Option<Cluster>,
}

impl Sites {
    /// Members in this process only.
    pub fn local(site: LocalSite) -> Sites {
        Sites {
            sites: vec![Site::Local(site)],
            home: BTreeMap::new(),
            kept_home: BTreeMap::new(),
            cluster: ClusterSection::default(),
            live: Vec::new(),
            cluster_state: None,
        }
    }

    /// Every member in this process because no node of `connected` is up
    /// (status and the journal still name the nodes that are down).
    pub fn fallback(site: LocalSite, connected: Cluster) -> Sites {
        Sites {
            cluster_state: Some(connected),
            ..Sites::local(site)
        }
    }

    /// Members on the nodes `connected` reached (at least one), placed by `section`.
    pub fn nodes(mut connected: Cluster, section: ClusterSection) -> Sites {
        let nodes = std::mem::take(&mut connected.links);
        let live = nodes.iter().map(|n| n.address.clone()).collect();
        Sites {
            sites: nodes.into_iter().map(Site::Node).collect(),
            home: BTreeMap::new(),
            kept_home: BTreeMap::new(),
            cluster: section,
            live,
            cluster_state: Some(connected),
        }
    }

    /// A node that was left out and now joins (see [`Cluster::rejoined`]).
    pub async fn rejoined(&mut self) -> Option<String> {
        self.cluster_state.as_mut()?.rejoined().await
    }

    /// Stop the cluster's node server and wait for it.
    pub async fn shut_down(&self) {
        if let Some(cluster) = &self.cluster_state {
            cluster.shut_down().await;
        }
    }

    /// The scenario's nodes that did not answer, and why.
    pub fn down(&self) -> BTreeMap<String, String> {
        self.cluster_state
            .as_ref()
            .map(|c| c.down.clone())
            .unwrap_or_default()
    }

    /// Every node's health, members, queue and traffic (`name` names a member).
    pub fn status(&self, name: impl Fn(MemberId) -> String) -> Vec<NodeStatus> {
        use std::sync::atomic::Ordering::Relaxed;
        let total: u64 = self
            .links()
            .map(|l| l.traffic.compute_ms.load(Relaxed))
            .sum();
        let mut out: Vec<NodeStatus> = self
            .sites
            .iter()
            .enumerate()
            .filter_map(|(site, s)| match s {
                Site::Node(link) => Some((site, link)),
                Site::Local(_) => None,
            })
            .map(|(site, link)| {
                let t = &link.traffic;
                let compute = t.compute_ms.load(Relaxed);
                NodeStatus {
                    address: link.address.clone(),
                    health: "up".into(),
                    members: self
                        .home
                        .iter()
                        .filter(|(_, &s)| s == site)
                        .map(|(&id, _)| name(id))
                        .collect(),
                    queue: t.in_flight.load(Relaxed),
                    compute_s: compute as f64 / 1e3,
                    compute_share: if total == 0 {
                        0.0
                    } else {
                        compute as f64 / total as f64
                    },
                    sent_bytes: t.sent.load(Relaxed),
                    received_bytes: t.received.load(Relaxed),
                }
            })
            .collect();
        for (address, why) in self.down() {
            out.push(NodeStatus {
                address,
                health: format!("down: {why}"),
                ..NodeStatus::default()
            });
        }
        out
    }

    /// Bytes sent to and received from every node so far.
    pub fn traffic(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        self.links().fold((0, 0), |(s, r), l| {
            (
                s + l.traffic.sent.load(Relaxed),
                r + l.traffic.received.load(Relaxed),
            )
        })
    }

    /// The node member `id` runs on (`None`: this process).
    pub fn node_of(&self, id: MemberId) -> Option<&str> {
        let site = *self.home.get(&id)?;
        self.live.get(site).map(String::as_str)
    }

    fn site_of(&self, id: MemberId) -> SiteResult<usize> {
        self.home
            .get(&id)
            .copied()
            .ok_or_else(|| StepError::Fatal(anyhow::anyhow!("member {id} has no site")))
    }

    pub async fn place(&mut self, id: MemberId, name: &str, learner: Learner) -> SiteResult<()> {
        let site = self.cluster.node_of(id, name, &self.live).unwrap_or(0);
        match &mut self.sites[site] {
            Site::Local(s) => s.place(id, name, learner).await?,
            Site::Node(n) => n.place(id, name, &learner).await?,
        }
        self.home.insert(id, site);
        Ok(())
    }

    pub async fn remove(&mut self, id: MemberId) {
        let Some(site) = self.home.remove(&id) else {
            return;
        };
        match &mut self.sites[site] {
            Site::Local(s) => s.remove(id),
            Site::Node(n) => n.remove(id).await,
        }
    }

    pub async fn learner(&self, id: MemberId) -> SiteResult<Learner> {
        match &self.sites[self.site_of(id)?] {
            Site::Local(s) => s.learner(id).await,
            Site::Node(n) => n.learner(id).await,
        }
    }

    pub async fn keep(&mut self) -> SiteResult<()> {
        self.kept_home = self.home.clone();
        for site in &mut self.sites {
            match site {
                Site::Local(s) => s.keep().await?,
                Site::Node(n) => n.keep().await?,
            }
        }
        Ok(())
    }

    pub async fn restore(&mut self) -> SiteResult<()> {
        self.home = self.kept_home.clone();
        for site in &mut self.sites {
            match site {
                Site::Local(s) => s.restore().await?,
                Site::Node(n) => n.restore().await?,
            }
        }
        Ok(())
    }

    /// Each site's share of `items` (by the member `owner` names), with
    /// each item's position; a member-less item goes to the first site.
    fn split<T>(
        &self,
        items: Vec<T>,
        owner: impl Fn(&T) -> Option<MemberId>,
    ) -> SiteResult<Vec<Vec<(usize, T)>>> {
        let mut parts: Vec<Vec<(usize, T)>> = (0..self.sites.len()).map(|_| Vec::new()).collect();
        for (i, item) in items.into_iter().enumerate() {
            let site = match owner(&item) {
                Some(id) => self.site_of(id)?,
                None => 0,
            };
            parts[site].push((i, item));
        }
        Ok(parts)
    }

    /// Generate on every site at once; the generations in request order.
    pub async fn generate(&self, requests: Vec<GenRequest>) -> SiteResult<Vec<Generation>> {
        let total = requests.len();
        let parts = self.split(requests, |r| r.adapter)?;
        let runs = parts
            .into_iter()
            .enumerate()
            .map(|(site, part)| async move {
                let (at, reqs): (Vec<usize>, Vec<GenRequest>) = part.into_iter().unzip();
                if reqs.is_empty() {
                    return Ok((at, Vec::new()));
                }
                let out = match &self.sites[site] {
                    Site::Local(s) => s.generate(reqs).await?,
                    Site::Node(n) => n.generate(reqs).await?,
                };
                Ok::<_, StepError>((at, out))
            });
        let mut slots: Vec<Option<Generation>> = (0..total).map(|_| None).collect();
        for result in futures::future::join_all(runs).await {
            let (at, out) = result?;
            for (i, g) in at.into_iter().zip(out) {
                slots[i] = Some(g);
            }
        }
        slots
            .into_iter()
            .map(|g| g.ok_or_else(|| StepError::Fatal(anyhow::anyhow!("a generation is missing"))))
            .collect()
    }

    /// Train on every site at once; every member's update.
    pub async fn train(
        &self,
        step: u64,
        rows: Vec<TrainRow>,
    ) -> SiteResult<BTreeMap<MemberId, Trained>> {
        let parts = self.split(rows, |r| Some(r.adapter))?;
        let runs = parts
            .into_iter()
            .enumerate()
            .map(|(site, part)| async move {
                let rows: Vec<TrainRow> = part.into_iter().map(|(_, r)| r).collect();
                if rows.is_empty() {
                    return Ok(BTreeMap::new());
                }
                match &self.sites[site] {
                    Site::Local(s) => s.train(step, rows).await,
                    Site::Node(n) => n.train(step, rows).await,
                }
            });
        let mut trained = BTreeMap::new();
        for result in futures::future::join_all(runs).await {
            trained.extend(result?);
        }
        Ok(trained)
    }

    /// Every site's compute since the last call, summed.
    pub async fn usage(&self) -> SiteResult<Usage> {
        let mut total = Usage::default();
        for site in &self.sites {
            let u = match site {
                Site::Local(s) => s.usage().await?,
                Site::Node(n) => n.usage().await?,
            };
            total.merge(&u);
        }
        Ok(total)
    }

    /// The node links, for status.
    pub fn links(&self) -> impl Iterator<Item = &NodeLink> {
        self.sites.iter().filter_map(|s| match s {
            Site::Node(n) => Some(n),
            Site::Local(_) => None,
        })
    }
}
