//! One commit's sorted changes applied to the tree by several threads, over disjoint subtrees.
//!
//! Owns: the plan that cuts the committed tree into runs of sibling subtrees whose key ranges
//! hold about equal numbers of changes ([`plan`]), the work of one run ([`run_job`], on any
//! thread), and the assembly of the results ([`assemble`]). A plan descends into a subtree
//! that holds too many changes ("expands" it) and cuts a leaf that holds too many into
//! pieces, so appends at the right edge of the key space still spread over jobs. Assembly
//! rebuilds the expanded nodes (the path above the jobs) from the jobs' runs, evenly filled.
//!
//! Must not touch: where the changes come from (the caller hands each job its own sorted
//! slice, [`Job::lo`]..[`Job::hi`]), the superblock, the cache, flushes. Who runs the jobs and
//! when is the engine's business.

use std::collections::HashMap;
use std::sync::Arc;

use birch_format::node::{ChildPtr, Node, NodeBody};
use birch_format::superblock::RootPtr;
use birch_format::{BlockAddr, Generation, Key};

use super::writer::TreeWriter;
use super::TreeCtx;
use crate::alloc::{Allocator, Birth};
use crate::error::{Error, Result};

/// One piece of a parallel apply: a run of sibling subtrees (or one piece of a cut leaf) and
/// the key range whose changes it applies.
pub struct Job {
    /// Smallest key this job owns.
    pub lo: Key,
    /// First key it does not own; `None` when it owns every key above `lo`.
    pub hi: Option<Key>,
    level: u8,
    ptrs: Vec<ChildPtr>,
    premade: Option<Vec<(Key, Vec<u8>)>>,
}

/// What a job made: the run of subtrees that replaces its own, and the nodes it wrote (for the
/// cache, once the commit is durable).
pub struct JobOutput {
    ptrs: Vec<ChildPtr>,
    /// Every node the job wrote.
    pub nodes: Vec<Arc<Node>>,
}

enum Part {
    /// The run of jobs[i].
    Job(usize),
    /// A committed leaf cut into pieces, one job each.
    Pieces { old: ChildPtr, jobs: Vec<usize> },
    /// A committed internal node at `level` rebuilt from its parts.
    Expand {
        old: ChildPtr,
        level: u8,
        parts: Vec<Part>,
    },
}

/// How one commit's apply is cut: the jobs, and how their outputs fit back together.
pub struct Plan {
    /// The jobs, in key order; run them in any order, on any threads.
    pub jobs: Vec<Job>,
    top: Part,
    root_level: u8,
}

/// Estimated number of changes in `[lo, hi)` from a sorted sample of their keys in which each
/// key stands for `weight` changes.
fn estimate(sample: &[Key], weight: usize, lo: &Key, hi: Option<&Key>) -> usize {
    let start = sample.partition_point(|k| k < lo);
    let end = hi.map_or(sample.len(), |h| sample.partition_point(|k| k < h));
    end.saturating_sub(start) * weight
}

struct Planner<'s, 'a> {
    ctx: TreeCtx<'a>,
    sample: &'s [Key],
    weight: usize,
    target: usize,
    jobs: Vec<Job>,
}

impl Planner<'_, '_> {
    /// Parts for the children of the committed internal node `node_ptr` at `level`, which owns
    /// `[lo, hi)`.
    fn expand(&mut self, node_ptr: ChildPtr, level: u8, lo: Key, hi: Option<Key>) -> Result<Part> {
        let node = self.ctx.read_child(&node_ptr, level)?;
        let NodeBody::Internal(ptrs) = &node.body else {
            return Err(Error::bug(format!(
                "parallel apply plan: node {:#x} at level {level} is a leaf",
                node_ptr.addr
            )));
        };
        let mut parts = Vec::new();
        // The run being gathered into one job: its first slot, its lower bound and estimate.
        let mut run: Option<(usize, Key, usize)> = None;
        for (slot, ptr) in ptrs.iter().enumerate() {
            let child_lo = if slot == 0 { lo } else { ptr.key };
            let child_hi = ptrs.get(slot + 1).map(|p| p.key).or(hi);
            let count = estimate(self.sample, self.weight, &child_lo, child_hi.as_ref());
            if count > self.target {
                if let Some((first, run_lo, _)) = run.take() {
                    parts.push(self.job(level - 1, &ptrs[first..slot], run_lo, Some(child_lo)));
                }
                let part = if level - 1 > 0 {
                    self.expand(*ptr, level - 1, child_lo, child_hi)?
                } else {
                    self.cut_leaf(*ptr, child_lo, child_hi, count)?
                };
                parts.push(part);
                continue;
            }
            let (first, run_lo, total) = run.unwrap_or((slot, child_lo, 0));
            if total > 0 && total + count > self.target {
                parts.push(self.job(level - 1, &ptrs[first..slot], run_lo, Some(child_lo)));
                run = Some((slot, child_lo, count));
            } else {
                run = Some((first, run_lo, total + count));
            }
        }
        if let Some((first, run_lo, _)) = run {
            parts.push(self.job(level - 1, &ptrs[first..], run_lo, hi));
        }
        Ok(Part::Expand {
            old: node_ptr,
            level,
            parts,
        })
    }

    fn job(&mut self, level: u8, ptrs: &[ChildPtr], lo: Key, hi: Option<Key>) -> Part {
        self.jobs.push(Job {
            lo,
            hi,
            level,
            ptrs: ptrs.to_vec(),
            premade: None,
        });
        Part::Job(self.jobs.len() - 1)
    }

    /// Cuts the committed leaf `ptr` (owning `[lo, hi)`, about `count` changes) at sample keys
    /// into pieces of about `target` changes; each piece starts as a new leaf holding the old
    /// leaf's items of its range.
    fn cut_leaf(&mut self, ptr: ChildPtr, lo: Key, hi: Option<Key>, count: usize) -> Result<Part> {
        let node = self.ctx.read_child(&ptr, 0)?;
        let NodeBody::Leaf(items) = &node.body else {
            return Err(Error::bug(format!(
                "parallel apply plan: node {:#x} at level 0 is internal",
                ptr.addr
            )));
        };
        let start = self.sample.partition_point(|k| *k < lo);
        let end = hi.map_or(self.sample.len(), |h| {
            self.sample.partition_point(|k| *k < h)
        });
        let inside = &self.sample[start..end];
        let pieces = count
            .div_ceil(self.target.max(1))
            .clamp(1, inside.len().max(1));
        let mut bounds = vec![lo];
        for i in 1..pieces {
            let key = inside[i * inside.len() / pieces];
            if key > *bounds.last().unwrap_or(&lo) {
                bounds.push(key);
            }
        }
        let mut jobs = Vec::with_capacity(bounds.len());
        for (i, piece_lo) in bounds.iter().enumerate() {
            let piece_hi = bounds.get(i + 1).copied().or(hi);
            let from = if i == 0 {
                0
            } else {
                items.partition_point(|(k, _)| k < piece_lo)
            };
            let to = piece_hi.map_or(items.len(), |h| items.partition_point(|(k, _)| *k < h));
            self.jobs.push(Job {
                lo: *piece_lo,
                hi: piece_hi,
                level: 0,
                ptrs: Vec::new(),
                premade: Some(items[from..to].to_vec()),
            });
            jobs.push(self.jobs.len() - 1);
        }
        Ok(Part::Pieces { old: ptr, jobs })
    }
}

/// Cuts the apply of about `sample.len() * weight` changes to the tree at `root` into about
/// `jobs` jobs of equal estimated size. `sample` holds every `weight`-th change key, sorted.
/// Returns `None` when the tree is a single leaf or the cut would give fewer than two jobs:
/// apply serially then.
pub fn plan(
    ctx: TreeCtx<'_>,
    root: RootPtr,
    sample: &[Key],
    weight: usize,
    jobs: usize,
) -> Result<Option<Plan>> {
    if root.level == 0 || sample.is_empty() {
        return Ok(None);
    }
    let total = sample.len() * weight;
    let mut planner = Planner {
        ctx,
        sample,
        weight,
        target: total.div_ceil(jobs.max(1)),
        jobs: Vec::new(),
    };
    let root_ptr = ChildPtr {
        key: Key::MIN,
        addr: root.addr,
        generation: root.generation,
    };
    let top = planner.expand(root_ptr, root.level, Key::MIN, None)?;
    if planner.jobs.len() < 2 {
        return Ok(None);
    }
    Ok(Some(Plan {
        jobs: planner.jobs,
        top,
        root_level: root.level,
    }))
}

/// Applies `changes` (sorted; exactly the changes with keys in `job.lo..job.hi`) to the job's
/// subtrees and writes the nodes it made (no flush). May run on any thread.
pub fn run_job(
    ctx: TreeCtx<'_>,
    alloc: &Allocator,
    generation: Generation,
    job: Job,
    changes: &[(Key, Option<&[u8]>)],
) -> Result<JobOutput> {
    let premade = job.premade.map(|items| (job.lo, items));
    let mut writer = TreeWriter::subtree(ctx, alloc, generation, job.level, job.ptrs, premade)?;
    writer.apply_sorted(changes)?;
    let ptrs = writer.finish_subtree();
    let nodes = writer.write_dirty()?;
    Ok(JobOutput { ptrs, nodes })
}

/// Puts the jobs' outputs (`outputs[i]` from `plan.jobs[i]`) together under new nodes for
/// the expanded path, in `writer` (a writer over the tree the plan was made from, with no
/// changes of its own yet), and makes the result its root: a root with one child gives way
/// to the child, so deletes shrink the tree as the serial apply does. Returns the nodes the
/// jobs wrote that the new tree references (for the cache, once the commit is durable).
pub fn assemble(
    writer: &mut TreeWriter<'_>,
    plan: Plan,
    outputs: Vec<JobOutput>,
) -> Result<Vec<Arc<Node>>> {
    let mut written: HashMap<u64, Arc<Node>> = HashMap::new();
    let mut outputs: Vec<Option<JobOutput>> = outputs
        .into_iter()
        .map(|mut out| {
            written.extend(out.nodes.drain(..).map(|n| (n.header.addr, n)));
            Some(out)
        })
        .collect();
    let mut level = plan.root_level;
    let mut run = assemble_part(writer, plan.top, &mut outputs)?;
    while run.len() > 1 {
        level += 1;
        run = writer.build_level(level, run)?;
    }
    let Some(mut root) = run.first().copied() else {
        writer.set_root(None)?;
        return Ok(written.into_values().collect());
    };
    let generation = writer.generation();
    while level > 0 {
        let addr = BlockAddr::new(root.addr);
        let node = if let Some(node) = writer.dirty_node(addr) {
            node
        } else if let Some(node) = written.get(&root.addr) {
            node.clone()
        } else {
            writer.ctx().read_child(&root, level)?
        };
        let NodeBody::Internal(ptrs) = &node.body else {
            break;
        };
        let [only] = ptrs.as_slice() else {
            break;
        };
        if root.generation < generation.get() {
            writer.retire(addr, Birth::new(root.generation));
        } else if writer.dirty_node(addr).is_some() {
            writer.discard(addr);
        } else if written.remove(&root.addr).is_some() {
            writer.free_new(addr);
        }
        root = *only;
        level -= 1;
    }
    writer.set_root(Some(RootPtr {
        addr: root.addr,
        generation: root.generation,
        level,
    }))?;
    Ok(written.into_values().collect())
}

fn take_output(outputs: &mut [Option<JobOutput>], index: usize) -> Result<Vec<ChildPtr>> {
    outputs
        .get_mut(index)
        .and_then(Option::take)
        .map(|out| out.ptrs)
        .ok_or_else(|| Error::bug(format!("parallel apply: no output of job {index}")))
}

/// The run that replaces `part`, at the part's level.
fn assemble_part(
    writer: &mut TreeWriter<'_>,
    part: Part,
    outputs: &mut [Option<JobOutput>],
) -> Result<Vec<ChildPtr>> {
    match part {
        Part::Job(index) => take_output(outputs, index),
        Part::Pieces { old, jobs } => {
            writer.retire(BlockAddr::new(old.addr), Birth::new(old.generation));
            let mut run = Vec::new();
            for index in jobs {
                run.extend(take_output(outputs, index)?);
            }
            Ok(run)
        }
        Part::Expand { old, level, parts } => {
            writer.retire(BlockAddr::new(old.addr), Birth::new(old.generation));
            let mut children = Vec::new();
            for part in parts {
                children.extend(assemble_part(writer, part, outputs)?);
            }
            if children.is_empty() {
                return Ok(Vec::new());
            }
            writer.build_level(level, children)
        }
    }
}
