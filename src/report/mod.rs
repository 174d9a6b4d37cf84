//! The run report: plots of a run's dynamics (as SVG and PNG) and an
//! `index.html` that shows them with a summary and the evaluation table.
//!
//! [`write`] reads `journal.jsonl`, `metrics.jsonl` and the optional
//! `eval.json` of a run directory and writes into an output directory (the
//! runtime uses `RUN/report/`):
//!
//! | file | shows |
//! |---|---|
//! | `proposals` | share of valid proposals, learnable problems per step |
//! | `complexity` | mean AST nodes and cyclomatic complexity of valid proposals, overall and per author |
//! | `solve_rate` | student solve rate per task kind |
//! | `coverage` | cumulative distinct program signatures, overall and per kind |
//! | `rewards` | mean reward per task kind, for proposers and solvers |
//! | `signal` | share of rollouts with a non-zero advantage per task kind, overall and per member |
//! | `fitness` | fitness per member (lines begin at spawn, × at cull or kill) |
//! | `ratings` | TrueSkill μ per member by role, and every member's σ |
//! | `lineage` | members over time, spawn edges with operators, culls and kills |
//!
//! each as `NAME.svg` and `NAME.png`, plus `index.html`.
//!
//! An incomplete run (no `end` event, missing steps or files) is reported as
//! far as it goes; what is missing is listed on the page and in
//! [`ReportSummary::warnings`]. A corrupt line is an error naming the file and
//! line, except a cut-short last line (what `kill -9` leaves), which is skipped
//! with a warning. Text in the PNGs uses an embedded DejaVu Sans, so output does
//! not depend on installed fonts.

mod chart;
pub mod experiment;
mod figures;
mod font;
mod history;
mod html;
mod input;
mod lineage;
mod order;
mod png;
mod raster;
mod scene;
mod svg;

use std::path::{Path, PathBuf};

use html::FigureRef;
use scene::Scene;

/// The plots [`write`] produces, each as `NAME.svg` and `NAME.png`.
pub const PLOTS: [&str; 9] = [
    "proposals",
    "complexity",
    "solve_rate",
    "coverage",
    "rewards",
    "signal",
    "fitness",
    "ratings",
    "lineage",
];

/// The page [`write`] produces.
pub const INDEX: &str = "index.html";

/// What [`write`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportSummary {
    /// `out_dir/index.html`.
    pub index: PathBuf,
    /// Every file written, the index last.
    pub files: Vec<PathBuf>,
    /// Steps with a metrics record.
    pub steps: usize,
    /// The last step that the metrics or the journal mention.
    pub last_step: Option<u64>,
    /// Whether the journal has an `end` event.
    pub complete: bool,
    /// What is missing or was skipped; also listed on the page.
    pub warnings: Vec<String>,
}

/// Why no report could be written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("{}: not a run directory (it does not exist or is not a directory)", path.display())]
    NotADirectory { path: PathBuf },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}:{line}: {message}", path.display())]
    Parse {
        path: PathBuf,
        /// 1-based.
        line: usize,
        message: String,
    },
    #[error("{}: cannot encode PNG: {message}", path.display())]
    Png { path: PathBuf, message: String },
}

/// Reads the run in `run_dir` and writes the report into `out_dir` (created if
/// needed; existing report files are overwritten).
pub fn write(
    run_dir: impl AsRef<Path>,
    out_dir: impl AsRef<Path>,
) -> Result<ReportSummary, ReportError> {
    let (run_dir, out_dir) = (run_dir.as_ref(), out_dir.as_ref());
    let data = input::read_run(run_dir)?;
    let mut warnings = data.warnings.clone();
    let history = history::build(&data, &mut warnings);
    std::fs::create_dir_all(out_dir).map_err(|source| ReportError::Io {
        path: out_dir.to_path_buf(),
        source,
    })?;

    let mut files = Vec::new();
    let mut refs = Vec::new();
    for (name, scene, caption) in scenes(&data, &history) {
        files.push(write_file(
            &out_dir.join(format!("{name}.svg")),
            svg::to_svg(&scene).as_bytes(),
        )?);
        let png_path = out_dir.join(format!("{name}.png"));
        let png = raster::to_png(&scene).map_err(|message| ReportError::Png {
            path: png_path.clone(),
            message,
        })?;
        files.push(write_file(&png_path, &png)?);
        refs.push(FigureRef {
            name,
            title: scene.title.clone(),
            caption,
            width: scene.width,
            height: scene.height,
        });
    }
    let page = html::page(run_dir, &data, &history, &refs, &warnings);
    let index = write_file(&out_dir.join(INDEX), page.as_bytes())?;
    files.push(index.clone());
    Ok(ReportSummary {
        index,
        files,
        steps: data.metrics.len(),
        last_step: history.last_step,
        complete: history.ended,
        warnings,
    })
}

/// Every figure with its file stem and caption, in page order.
fn scenes(
    data: &input::RunData,
    history: &history::History,
) -> Vec<(&'static str, Scene, &'static str)> {
    let m = &data.metrics;
    vec![
        (
            "proposals",
            chart::render(&figures::proposals(m)),
            "Share of the proposed problems that were valid (their program ran, deterministically, on their input), and the number of learnable problems: solved in some of their rollouts but not all, the ones a teacher is rewarded for.",
        ),
        (
            "solve_rate",
            chart::render(&figures::solve_rate(m)),
            "Fraction of problems the students solved, per task kind; a gap is a step without problems of that kind. The teacher–student oscillation shows here.",
        ),
        (
            "complexity",
            chart::render(&figures::complexity(m)),
            "Mean AST node count and cyclomatic complexity of the valid programs proposed in each step: all authors (black) and each author.",
        ),
        (
            "coverage",
            chart::render(&figures::coverage(m)),
            "Problem-space coverage: cumulative number of distinct program signatures (AST nodes, max depth, node types, cyclomatic), overall and per task kind.",
        ),
        (
            "rewards",
            chart::render(&figures::rewards(m)),
            "Mean reward per task kind, for the proposer role (teachers) and the solver role (students).",
        ),
        (
            "signal",
            chart::render(&figures::signal(m)),
            "Share of the rollouts whose TRR++ advantage is not zero, per task kind: all members (black) and each member. A rollout with a zero advantage (its whole advantage group scored alike) adds nothing to the gradient.",
        ),
        (
            "fitness",
            chart::render(&figures::fitness(m, history)),
            "Fitness of every member, by role; a line begins when a member appears and ends with × where it was culled or killed.",
        ),
        (
            "ratings",
            chart::render(&figures::ratings(m)),
            "TrueSkill rating of every member: the mean μ by role (a teacher wins a match when the student fails), and the uncertainty σ, which starts at the prior (8.33) and shrinks as a member's matches are rated.",
        ),
        (
            "lineage",
            lineage::render(history),
            "Lineage: one row per member from birth to cull (red ×), kill (black ×) or the end of the run; edges run from parents to offspring, labelled with the operators; diamonds mark faults.",
        ),
    ]
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<PathBuf, ReportError> {
    std::fs::write(path, bytes).map_err(|source| ReportError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(path.to_path_buf())
}
