//! `populora ctl DIR COMMAND`: control a live run over its socket.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use populora::scenario::Role;

use crate::runtime::control::{self, Command};

#[derive(Parser)]
pub struct Args {
    /// The run directory.
    pub dir: PathBuf,
    #[command(subcommand)]
    pub command: Ctl,
}

#[derive(Subcommand)]
pub enum Ctl {
    /// Step, phase and members (JSON).
    Status,
    /// Remove a member at the next step boundary.
    Kill {
        member: String,
    },
    /// Add a member of ROLE (teacher or student) at the next step boundary.
    Inject {
        role: String,
        /// Parents (default: chosen by tournament selection).
        #[arg(long = "from", num_args = 1..)]
        from: Vec<String>,
        /// Operator, e.g. `svd_noise` or `dare:p=0.5` (default: the scenario's draw).
        #[arg(long)]
        op: Option<String>,
    },
    /// Hold the run at the next step boundary.
    Pause,
    Resume,
    /// Stop at the next step boundary, with a checkpoint.
    Stop,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let command = match args.command {
        Ctl::Status => Command::Status,
        Ctl::Kill { member } => Command::Kill { member },
        Ctl::Inject { role, from, op } => Command::Inject {
            role: match role.as_str() {
                "teacher" => Role::Teacher,
                "student" => Role::Student,
                other => anyhow::bail!("role must be teacher or student, not `{other}`"),
            },
            from,
            op,
        },
        Ctl::Pause => Command::Pause,
        Ctl::Resume => Command::Resume,
        Ctl::Stop => Command::Stop,
    };
    let reply = control::send(&control::socket_of(&args.dir), &command)?;
    match (&reply.status, reply.ok) {
        (Some(status), true) => println!("{}", serde_json::to_string_pretty(status)?),
        (_, true) => println!("{}", reply.message),
        (_, false) => anyhow::bail!("{}", reply.message),
    }
    Ok(())
}
