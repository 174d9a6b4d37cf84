//! `[cluster]`: worker nodes that host members, and which member runs where.
//!
//! Placement is a pure function of the scenario and of the nodes that are up:
//! a pinned member goes to its pin when that node is up; every other member
//! (and a pinned one whose node is down) goes to `live[id % live.len()]`,
//! round robin by member id. No clock, address order or arrival order enters.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// `[cluster]`
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterSection {
    /// Worker nodes, `host:port`, each started with `populora node --listen`.
    /// Default: none (every member runs in the `run` process).
    pub nodes: Vec<String>,
    /// How members are spread over the nodes. Default: `"round_robin"`.
    pub placement: Placement,
    /// Members pinned to a node: `{ "teacher-0" = "host:port" }`. A pin whose
    /// node is down falls back to round robin. Default: none.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub pins: BTreeMap<String, String>,
    /// The shared secret every node was started with (a file of mode 0600).
    /// Required when `nodes` is given (or `populora run --cookie-file`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cookie_file: Option<PathBuf>,
    /// Encrypt the connections to the nodes (each started with `--tls-cert`
    /// and `--tls-key`). Default: none (plain TCP).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSection>,
}

/// `[cluster.tls]`: how the coordinator checks the nodes' certificates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    /// The certificate authority (PEM) that signed every node's certificate.
    pub ca: PathBuf,
    /// The name the nodes' certificates are issued for. Default: `"populora-node"`.
    #[serde(default = "default_server_name")]
    pub server_name: String,
}

fn default_server_name() -> String {
    "populora-node".into()
}

/// `cluster.placement`
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Member `id` on node `id % nodes` (pins first).
    #[default]
    RoundRobin,
}

impl ClusterSection {
    /// Whether every member runs in the `run` process.
    pub fn is_local(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The index in `live` of the node member `id` (named `name`) runs on;
    /// `None` when no node is up (the member runs in the `run` process).
    pub fn node_of(&self, id: u64, name: &str, live: &[String]) -> Option<usize> {
        if live.is_empty() {
            return None;
        }
        let pinned = self
            .pins
            .get(name)
            .and_then(|node| live.iter().position(|n| n == node));
        Some(pinned.unwrap_or((id % live.len() as u64) as usize))
    }
}

/// Why `addr` is not a `host:port` node address, if it is not.
pub fn check_address(addr: &str) -> Result<(), String> {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(format!("{addr:?} is not host:port"));
    };
    if host.is_empty() {
        return Err(format!("{addr:?} has no host"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(format!("{addr:?} has no valid port (1..=65535)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_is_round_robin_by_id_with_pins_first() {
        let mut c = ClusterSection {
            nodes: vec!["a:1".into(), "b:2".into()],
            ..ClusterSection::default()
        };
        let live = c.nodes.clone();
        let homes: Vec<_> = (0..4).map(|id| c.node_of(id, "x", &live)).collect();
        assert_eq!(homes, [Some(0), Some(1), Some(0), Some(1)]);
        c.pins.insert("teacher-0".into(), "b:2".into());
        assert_eq!(c.node_of(0, "teacher-0", &live), Some(1));
        // The pin's node is down: round robin over the nodes that are up.
        assert_eq!(c.node_of(1, "teacher-0", &["a:1".into()]), Some(0));
        assert_eq!(c.node_of(1, "teacher-0", &[]), None);
    }

    #[test]
    fn addresses_need_a_host_and_a_port() {
        assert!(check_address("127.0.0.1:7001").is_ok());
        assert!(check_address("node-3.lab:9000").is_ok());
        for bad in ["127.0.0.1", ":7001", "h:0", "h:port", "h:70000"] {
            assert!(check_address(bad).is_err(), "{bad}");
        }
    }
}
