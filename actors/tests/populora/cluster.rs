//! A run across worker nodes (`populora node`), each its own process on
//! 127.0.0.1, on `scenarios/tiny.toml`: determinism across runs and against
//! the same run in one process, a node killed mid-run, refused cookies and
//! models, live commands on members that run on nodes, and replay.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

use crate::common::{journal, ok, populora, text, wait_for};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("populora-cluster-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A cookie file of mode 0600 in `dir`.
fn cookie(dir: &Path, secret: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(format!("cookie-{secret}"));
    std::fs::write(&path, secret).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// A `populora node` process on a free loopback port; killed on drop.
struct Node {
    child: Child,
    address: String,
    log: PathBuf,
}

impl Node {
    fn start(dir: &Path, cookie: &Path, model: Option<&Path>) -> Node {
        Node::start_with(
            dir,
            cookie,
            model.map_or(vec![], |m| vec!["--model".into(), m.into()]),
        )
    }

    fn start_with(dir: &Path, cookie: &Path, extra: Vec<PathBuf>) -> Node {
        Node::start_env(dir, cookie, extra, &[])
    }

    fn start_env(dir: &Path, cookie: &Path, extra: Vec<PathBuf>, env: &[(&str, &str)]) -> Node {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let address = format!("127.0.0.1:{port}");
        let log = dir.join(format!("node-{port}.log"));
        let mut args = vec![
            "node",
            "--listen",
            &address,
            "--cookie-file",
            cookie.to_str().unwrap(),
        ];
        args.extend(extra.iter().map(|a| a.to_str().unwrap()));
        let mut child = populora(&args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.contains("listening on"), "node did not start: {line}");
        Node {
            child,
            address,
            log,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tiny(dir: &Path, edit: impl Fn(String) -> String) -> PathBuf {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios/tiny.toml");
    let file = dir.join("tiny.toml");
    std::fs::write(&file, edit(std::fs::read_to_string(base).unwrap())).unwrap();
    file
}

fn run_args<'a>(file: &'a Path, out: &'a Path, nodes: &'a str, cookie: &'a Path) -> Vec<&'a str> {
    vec![
        "run",
        file.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--nodes",
        nodes,
        "--cookie-file",
        cookie.to_str().unwrap(),
    ]
}

/// `populora run` in the background (its stderr in `out`.log).
fn spawn_run(file: &Path, out: &Path, nodes: &str, cookie: &Path) -> Child {
    let log = std::fs::File::create(out.with_extension("log")).unwrap();
    populora(&run_args(file, out, nodes, cookie))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

/// Wait for a background run; its stderr when it failed.
fn finished(mut run: Child, out: &Path) {
    let status = run.wait().unwrap();
    let log = std::fs::read_to_string(out.with_extension("log")).unwrap_or_default();
    assert!(status.success(), "{log}");
}

/// Every `step` event's line, in order.
fn steps(dir: &Path) -> Vec<String> {
    journal(dir)
        .lines()
        .filter(|l| l.contains(r#""event":"step""#) || l.contains(r#""event":"end""#))
        .map(str::to_string)
        .collect()
}

#[test]
fn two_nodes_give_the_same_checksums_twice_and_the_same_as_one_process() {
    let dir = scratch("determinism");
    let secret = cookie(&dir, "alpha");
    // student-1 (member 3, on the second node) panics once, in the first
    // run's step 2: the step is retried and ends as if it had not.
    let fault = [("POPULORA_FAULT", "student-1@2:train")];
    let (a, b) = (
        Node::start(&dir, &secret, None),
        Node::start_env(&dir, &secret, vec![], &fault),
    );
    let nodes = format!("{},{}", a.address, b.address);
    let file = tiny(&dir, |t| t);
    let (one, two, local) = (dir.join("one"), dir.join("two"), dir.join("local"));
    for out in [&one, &two] {
        ok(populora(&run_args(&file, out, &nodes, &secret))
            .output()
            .unwrap());
    }
    ok(populora(&[
        "run",
        file.to_str().unwrap(),
        "--out",
        local.to_str().unwrap(),
    ])
    .output()
    .unwrap());
    assert_eq!(steps(&one).len(), 5, "{}", journal(&one));
    assert!(
        journal(&one).contains(r#""event":"fault","step":2,"member":"student-1""#),
        "{}",
        journal(&one)
    );
    assert_eq!(steps(&one), steps(&two));
    // Lossless wire: tiny's batches, split in two, fall in the same kernel
    // ranges as whole, so even the in-process run agrees bit for bit.
    assert_eq!(steps(&one), steps(&local));
    let layout = journal(&one)
        .lines()
        .find(|l| l.contains(r#""event":"layout""#))
        .unwrap()
        .to_string();
    for (member, node) in [("teacher-0", &a), ("teacher-1", &b), ("student-1", &b)] {
        assert!(
            layout.contains(&format!(r#""{member}":"{}""#, node.address)),
            "{layout}"
        );
    }
    let metrics = std::fs::read_to_string(one.join("metrics.jsonl")).unwrap();
    assert!(metrics.contains(r#""wire_bytes":{"sent":"#), "{metrics}");
}

#[test]
fn a_node_killed_mid_run_hands_its_members_to_the_others_and_the_run_completes() {
    let dir = scratch("kill");
    let secret = cookie(&dir, "beta");
    let a = Node::start(&dir, &secret, None);
    let mut b = Node::start(&dir, &secret, None);
    let nodes = format!("{},{}", a.address, b.address);
    let file = tiny(&dir, |t| t.replace("steps = 4 ", "steps = 8 "));
    let out = dir.join("run");
    let run = spawn_run(&file, &out, &nodes, &secret);
    wait_for("step 3", Duration::from_secs(300), || {
        steps(&out).len() >= 3
    });
    b.child.kill().unwrap();
    finished(run, &out);
    let journal = journal(&out);
    assert!(
        journal.contains(r#""event":"node_lost","step":"#),
        "{journal}"
    );
    assert!(journal.contains(&format!(r#""node":"{}""#, b.address)));
    assert!(journal.contains(r#""event":"end","step":8"#), "{journal}");
    // After the loss every member runs on the node still up.
    let after = journal
        .lines()
        .skip_while(|l| !l.contains(r#""event":"node_lost""#))
        .find(|l| l.contains(r#""event":"layout""#))
        .unwrap();
    assert!(!after.contains(&format!(r#"":"{}""#, b.address)), "{after}");
    assert!(after.contains(&format!(r#""{}":"#, b.address)), "{after}");
}

#[test]
fn a_wrong_cookie_and_a_wrong_model_are_refused_on_both_sides() {
    let dir = scratch("refused");
    let (right, wrong) = (cookie(&dir, "gamma"), cookie(&dir, "delta"));
    let file = tiny(&dir, |t| t);
    let node = Node::start(&dir, &right, None);
    let out = populora(&run_args(&file, &dir.join("cookie"), &node.address, &wrong))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("cookies do not match"),
        "{}",
        text(&out.stderr)
    );
    wait_for("the node's refusal", Duration::from_secs(10), || {
        node.log().contains("refused")
    });

    // The same shape with other weights: another base model.
    let other = dir.join("other.gguf");
    let spec = populora::scenario::TinyModelSection {
        max_positions: 1536,
        seed: 1,
        ..Default::default()
    }
    .spec();
    let (model, vocab) = populora::base::tiny::build(&spec).unwrap();
    vocab.write_gguf(&other, &model).unwrap();
    let node = Node::start(&dir, &right, Some(&other));
    let out = populora(&run_args(&file, &dir.join("model"), &node.address, &right))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("fingerprint"), "{err}");
    assert!(
        node.log().contains("refused: the coordinator's base model"),
        "{}",
        node.log()
    );

    // A cookie others can read is refused before anything starts.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&wrong, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = populora(&[
        "node",
        "--listen",
        "127.0.0.1:1",
        "--cookie-file",
        wrong.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    assert!(
        text(&out.stderr).contains("chmod 600"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn live_commands_reach_members_on_nodes_and_the_run_replays() {
    let dir = scratch("ctl");
    let secret = cookie(&dir, "epsilon");
    let (a, b) = (
        Node::start(&dir, &secret, None),
        Node::start(&dir, &secret, None),
    );
    let nodes = format!("{},{}", a.address, b.address);
    let file = tiny(&dir, |t| t.replace("students = 2 ", "students = 4 "));
    let out = dir.join("run");
    let run = spawn_run(&file, &out, &nodes, &secret);
    let ctl = |args: &[&str]| {
        let mut all = vec!["ctl", out.to_str().unwrap()];
        all.extend_from_slice(args);
        ok(populora(&all).output().unwrap())
    };
    wait_for("the control socket", Duration::from_secs(120), || {
        out.join("control.sock").exists()
    });
    ctl(&["pause"]);
    wait_for("the pause", Duration::from_secs(120), || {
        ctl(&["status"]).contains(r#""paused": true"#)
    });
    let status = ctl(&["status"]);
    assert!(
        status.contains(&format!(r#""address": "{}""#, b.address)),
        "{status}"
    );
    assert!(status.contains(r#""health": "up""#), "{status}");
    // A node serves one run at a time.
    let other = populora(&run_args(&file, &dir.join("other"), &nodes, &secret))
        .output()
        .unwrap();
    assert!(!other.status.success());
    assert!(
        text(&other.stderr).contains("serves another run"),
        "{}",
        text(&other.stderr)
    );
    // student-3 (member 5) runs on the second node.
    assert!(ctl(&["kill", "student-3"]).contains("will kill student-3"));
    assert!(ctl(&["inject", "teacher", "--op", "gaussian"]).contains("will inject"));
    ctl(&["resume"]);
    finished(run, &out);
    let journal = journal(&out);
    assert!(
        journal
            .contains(r#""cmd":"kill","member":"student-3"},"source":"ctl","outcome":"applied""#),
        "{journal}"
    );
    let replayed = ok(populora(&["replay", out.to_str().unwrap()])
        .output()
        .unwrap());
    assert!(replayed.contains("replay matches"), "{replayed}");
}

#[test]
fn nodes_started_with_tls_serve_a_coordinator_that_trusts_their_ca_and_refuse_a_plain_one() {
    let dir = scratch("tls");
    let secret = cookie(&dir, "zeta");
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let node_key = rcgen::KeyPair::generate().unwrap();
    let node_cert = rcgen::CertificateParams::new(vec!["populora-node".to_string()])
        .unwrap()
        .signed_by(&node_key, &ca, &ca_key)
        .unwrap();
    let (ca_pem, cert_pem, key_pem) = (
        dir.join("ca.pem"),
        dir.join("node.pem"),
        dir.join("node.key"),
    );
    std::fs::write(&ca_pem, ca.pem()).unwrap();
    std::fs::write(&cert_pem, node_cert.pem()).unwrap();
    std::fs::write(&key_pem, node_key.serialize_pem()).unwrap();
    let tls = vec!["--tls-cert".into(), cert_pem, "--tls-key".into(), key_pem];
    let node = Node::start_with(&dir, &secret, tls);
    let plain = tiny(&dir, |t| t);
    let out = populora(&run_args(
        &plain,
        &dir.join("plain"),
        &node.address,
        &secret,
    ))
    .output()
    .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("expects TLS"),
        "{}",
        text(&out.stderr)
    );
    let secure = dir.join("secure.toml");
    let text_ = std::fs::read_to_string(&plain).unwrap()
        + &format!("\n[cluster.tls]\nca = {:?}\n", ca_pem.to_str().unwrap());
    std::fs::write(&secure, text_).unwrap();
    let run = dir.join("secure");
    ok(populora(&run_args(&secure, &run, &node.address, &secret))
        .output()
        .unwrap());
    assert_eq!(steps(&run).len(), 5, "{}", journal(&run));
}

#[test]
fn with_every_node_lost_the_run_finishes_in_the_coordinator() {
    let dir = scratch("alone");
    let secret = cookie(&dir, "eta");
    let mut node = Node::start(&dir, &secret, None);
    let file = tiny(&dir, |t| t.replace("steps = 4 ", "steps = 6 "));
    let out = dir.join("run");
    let run = spawn_run(&file, &out, &node.address, &secret);
    wait_for("step 2", Duration::from_secs(300), || {
        steps(&out).len() >= 2
    });
    node.child.kill().unwrap();
    finished(run, &out);
    let journal = journal(&out);
    assert!(journal.contains(r#""event":"end","step":6"#), "{journal}");
    let last_layout = journal
        .lines()
        .rfind(|l| l.contains(r#""event":"layout""#))
        .unwrap();
    assert!(
        last_layout.contains(r#""teacher-0":"local""#),
        "{last_layout}"
    );
    assert!(
        last_layout.contains(&format!(r#""down":{{"{}":"down: "#, node.address)),
        "{last_layout}"
    );
}

#[test]
fn a_coordinator_killed_mid_run_resumes_on_its_nodes_and_ends_the_same() {
    let dir = scratch("coordinator");
    let secret = cookie(&dir, "theta");
    let (a, b) = (
        Node::start(&dir, &secret, None),
        Node::start(&dir, &secret, None),
    );
    let nodes = format!("{},{}", a.address, b.address);
    let file = tiny(&dir, |t| t.replace("steps = 4 ", "steps = 6 "));
    let whole = dir.join("whole");
    ok(populora(&run_args(&file, &whole, &nodes, &secret))
        .output()
        .unwrap());
    let out = dir.join("crashed");
    let mut run = spawn_run(&file, &out, &nodes, &secret);
    wait_for("the step-2 checkpoint", Duration::from_secs(300), || {
        journal(&out).contains(r#""event":"checkpoint","step":2"#)
    });
    run.kill().unwrap();
    run.wait().unwrap();
    ok(populora(&["resume", out.to_str().unwrap()])
        .output()
        .unwrap());
    let end = |d: &Path| steps(d).pop().unwrap();
    assert_eq!(end(&whole), end(&out));
}

#[test]
fn a_node_that_stops_answering_is_noticed_by_its_heartbeat() {
    let dir = scratch("silent");
    let secret = cookie(&dir, "iota");
    let a = Node::start(&dir, &secret, None);
    let b = Node::start(&dir, &secret, None);
    let nodes = format!("{},{}", a.address, b.address);
    let file = tiny(&dir, |t| t.replace("steps = 4 ", "steps = 6 "));
    let out = dir.join("run");
    let run = spawn_run(&file, &out, &nodes, &secret);
    wait_for("step 3", Duration::from_secs(300), || {
        steps(&out).len() >= 3
    });
    // Frozen, its socket still open: only the heartbeat can tell.
    unsafe { libc::kill(b.child.id() as i32, libc::SIGSTOP) };
    finished(run, &out);
    let journal = journal(&out);
    assert!(
        journal.contains(r#""message":"no heartbeat within 10s""#),
        "{journal}"
    );
    assert!(journal.contains(r#""event":"end","step":6"#), "{journal}");
}
