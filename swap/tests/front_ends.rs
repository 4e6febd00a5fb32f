//! Front-end rules on the cpu backend: layer-group linking and hooks, keyed keys / prefetch
//! mapping / eligibility / tags, and the pipeline's chunks, groups, margins and summary.

use std::collections::BTreeMap;
use std::sync::Arc;

use hprt_platform::{CpuBackend, CpuConfig, DType, DeviceBuffer, ErrorKind, Platform, Stream};
use hprt_swap::{
    offload_summary_table, proportional_slice, DeviceTensor, KeyedSwap, ModuleTag, OffloadTag,
    Packed, PipelineConfig, PipelineOffload, Saved, SwapError, SwapManager, SwapState, TensorKey,
    TensorKeyManager,
};
use proptest::prelude::*;

mod common;
use common::bytes_of;

fn cpu(device_memory: usize) -> (Arc<dyn Platform>, Stream) {
    let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig {
        device_memory,
        ..CpuConfig::default()
    }));
    let s = p.create_stream().unwrap();
    (p, s)
}

fn tensor(p: &Arc<dyn Platform>, s: &Stream, bytes: usize, fill: u8) -> (DeviceBuffer, Saved) {
    let buf = p.alloc_device(bytes).unwrap();
    p.write_device_sync(&buf, 0, &vec![fill; bytes], s).unwrap();
    let t = DeviceTensor::whole(buf.clone(), DType::U8, vec![bytes]);
    (buf, Saved::Tensor(t))
}

// --- layer groups (hyper_parallel) --------------------------------------------------------

#[test]
fn the_last_linked_group_is_the_last_group() {
    let (p, s) = cpu(1 << 20);
    let mut m = SwapManager::new(Arc::clone(&p)).unwrap();
    let (a, b) = (m.new_layer(), m.new_layer());
    assert!(!m.is_last_group("swap_group_1"), "not linked yet");
    m.set_forward_prefetch_layer(a, b).unwrap();
    assert!(!m.is_last_group("swap_group_0"));
    assert!(m.is_last_group("swap_group_1"));
    assert!(!m.is_last_group("unknown"));
    m.forward_pre(a).unwrap();
    let r = m.save(tensor(&p, &s, 512, 1).1).unwrap();
    assert_eq!(m.state(r).unwrap(), SwapState::Device);
    m.forward_post(a, &s).unwrap();
    m.forward_pre(b).unwrap();
    m.forward_post(b, &s).unwrap();
    assert_eq!(m.state(r).unwrap(), SwapState::Host);
}

#[test]
fn linking_is_idempotent_and_first_link_wins() {
    let (p, s) = cpu(1 << 20);
    let mut m = SwapManager::new(Arc::clone(&p)).unwrap();
    let (a, b, c) = (m.new_layer(), m.new_layer(), m.new_layer());
    for _ in 0..3 {
        m.set_forward_prefetch_layer(a, b).unwrap();
    }
    m.set_forward_prefetch_layer(a, c).unwrap(); // a.next stays b
    assert!(m.set_forward_prefetch_layer(a, a).is_err());
    let (buf, v) = tensor(&p, &s, 512, 3);
    m.forward_pre(a).unwrap();
    let r = m.save(v).unwrap();
    m.forward_post(a, &s).unwrap(); // a has a next: offloads
    m.forward_pre(b).unwrap();
    m.forward_post(b, &s).unwrap(); // b's prev is a: a released
    assert_eq!(buf.len(), 0);
    assert!(matches!(
        m.get(r),
        Err(SwapError::WrongState {
            actual: SwapState::Host,
            ..
        })
    ));
}

#[test]
fn unlinked_layers_link_anew_in_another_order_between_iterations() {
    let (p, s) = cpu(1 << 20);
    let mut m = SwapManager::new(Arc::clone(&p)).unwrap();
    let (a, b) = (m.new_layer(), m.new_layer());
    m.set_forward_prefetch_layer(a, b).unwrap();
    assert!(m.set_forward_prefetch_layer(b, a).is_err(), "a cycle");
    m.forward_pre(a).unwrap();
    m.save(tensor(&p, &s, 256, 1).1).unwrap();
    assert!(
        matches!(m.unlink(a), Err(SwapError::Order(_))),
        "a group holding values keeps its place"
    );
    m.forward_post(a, &s).unwrap();
    m.end_iteration().unwrap();
    m.unlink(a).unwrap();
    m.unlink(b).unwrap();
    m.set_forward_prefetch_layer(b, a).unwrap(); // the other way round now
    assert!(m.is_last_group("swap_group_0"));
    assert!(!m.is_last_group("swap_group_1"));
    // b (first now) offloads after its forward and a waits for it.
    let (buf, v) = tensor(&p, &s, 512, 7);
    m.forward_pre(b).unwrap();
    let r = m.save(v).unwrap();
    m.forward_post(b, &s).unwrap();
    m.forward_pre(a).unwrap();
    m.forward_post(a, &s).unwrap();
    assert_eq!(buf.len(), 0);
    m.backward_pre(a, &s).unwrap();
    m.backward_pre(b, &s).unwrap();
    assert_eq!(bytes_of(&p, &s, m.get(r).unwrap()), vec![7; 512]);
}

#[test]
fn last_layer_is_not_offloaded_and_recompute_forward_is_skipped() {
    let (p, s) = cpu(1 << 20);
    let mut m = SwapManager::new(Arc::clone(&p)).unwrap();
    let (a, b) = (m.new_layer(), m.new_layer());
    m.set_forward_prefetch_layer(a, b).unwrap();
    m.forward_pre(a).unwrap();
    m.forward_post(a, &s).unwrap();
    m.forward_pre(b).unwrap();
    let (buf, v) = tensor(&p, &s, 256, 4);
    let r = m.save(v).unwrap();
    m.forward_post(b, &s).unwrap();
    assert_eq!(buf.len(), 256, "the last layer keeps its activations");
    m.backward_pre(b, &s).unwrap();
    // A checkpointed layer re-running forward inside its backward must not offload again.
    m.forward_pre(b).unwrap();
    m.forward_post(b, &s).unwrap();
    assert_eq!(bytes_of(&p, &s, m.get(r).unwrap()), vec![4; 256]);
}

#[test]
fn layer_group_reload_out_of_memory_can_be_retried() {
    let (p, s) = cpu(48 << 10);
    let mut m = SwapManager::new(Arc::clone(&p)).unwrap();
    let (a, b) = (m.new_layer(), m.new_layer());
    m.set_forward_prefetch_layer(a, b).unwrap();
    m.forward_pre(a).unwrap();
    let (_, v) = tensor(&p, &s, 16 << 10, 5);
    let r = m.save(v).unwrap();
    m.forward_post(a, &s).unwrap();
    m.forward_pre(b).unwrap();
    m.forward_post(b, &s).unwrap();
    let filler = p.alloc_device(40 << 10).unwrap();
    // The prefetch of layer a finds no room: deferred, not an error (layer b's backward goes
    // on, ISSUE 32 item 11); layer a stays on the host with its copy.
    m.backward_pre(b, &s).unwrap();
    assert_eq!(m.state(r).unwrap(), SwapState::Host);
    m.backward_post(b).unwrap();
    // Layer a's own load is the error, and a retry once there is room succeeds.
    let e = m.backward_pre(a, &s).unwrap_err();
    assert_eq!(e.platform_kind(), Some(ErrorKind::OutOfMemory));
    assert_eq!(m.state(r).unwrap(), SwapState::Host);
    p.free_device(&filler).unwrap();
    m.backward_pre(a, &s).unwrap();
    assert_eq!(bytes_of(&p, &s, m.get(r).unwrap()), vec![5; 16 << 10]);
}

#[test]
fn unknown_layers_and_saves_outside_a_layer_are_errors() {
    let (p, _) = cpu(1 << 20);
    let mut m = SwapManager::new(Arc::clone(&p)).unwrap();
    assert!(matches!(
        m.save(Saved::Other(Arc::new(1u8))),
        Err(SwapError::Order(_))
    ));
    let mut other = SwapManager::new(p).unwrap();
    let foreign = {
        other.new_layer();
        other.new_layer()
    };
    assert!(matches!(
        m.forward_pre(foreign),
        Err(SwapError::Unknown { .. })
    ));
}

/// One iteration of two linked layers saving one tensor each; returns the layers' buffers.
fn two_layer_forward(
    p: &Arc<dyn Platform>,
    s: &Stream,
    m: &mut SwapManager,
    (a, b): (hprt_swap::LayerId, hprt_swap::LayerId),
    fill: u8,
) -> (DeviceBuffer, hprt_swap::SavedRef, hprt_swap::SavedRef) {
    m.forward_pre(a).unwrap();
    let (buf_a, v) = tensor(p, s, 4096, fill);
    let ra = m.save(v).unwrap();
    m.forward_post(a, s).unwrap();
    m.forward_pre(b).unwrap();
    let (_, v) = tensor(p, s, 4096, fill + 1);
    let rb = m.save(v).unwrap();
    m.forward_post(b, s).unwrap();
    (buf_a, ra, rb)
}

#[test]
fn an_iteration_aborted_in_backward_does_not_break_the_next() {
    let (p, s) = cpu(64 << 10);
    let mut m = SwapManager::new(Arc::clone(&p)).unwrap();
    let layers = (m.new_layer(), m.new_layer());
    m.set_forward_prefetch_layer(layers.0, layers.1).unwrap();
    two_layer_forward(&p, &s, &mut m, layers, 1);
    // The prefetch runs out of memory (deferred, not an error); the loop then aborts the
    // iteration midway through its backward.
    p.synchronize_device().unwrap();
    let filler = p.alloc_device(p.mem_info().unwrap().free - 1024).unwrap();
    m.backward_pre(layers.1, &s).unwrap();
    m.end_iteration().unwrap();
    p.free_device(&filler).unwrap();
    // The next iteration runs its whole schedule: layer 0's offload is waited and released at
    // layer 1's forward_post, and every value comes back.
    let (buf_a, ra, rb) = two_layer_forward(&p, &s, &mut m, layers, 7);
    assert_eq!(buf_a.len(), 0, "layer 0 released by layer 1's forward_post");
    m.backward_pre(layers.1, &s).unwrap();
    assert_eq!(bytes_of(&p, &s, &m.take(rb).unwrap()), vec![8; 4096]);
    m.backward_post(layers.1).unwrap();
    m.backward_pre(layers.0, &s).unwrap();
    assert_eq!(bytes_of(&p, &s, &m.take(ra).unwrap()), vec![7; 4096]);
    m.backward_post(layers.0).unwrap();
}

#[test]
fn out_of_order_layer_calls_are_typed_errors() {
    let (p, s) = cpu(1 << 20);
    let mut m = SwapManager::new(Arc::clone(&p)).unwrap();
    let (a, b, c) = (m.new_layer(), m.new_layer(), m.new_layer());
    m.set_forward_prefetch_layer(a, b).unwrap();
    m.set_forward_prefetch_layer(b, c).unwrap();
    let order = |r: Result<(), SwapError>| assert!(matches!(r, Err(SwapError::Order(_))), "{r:?}");
    order(m.set_forward_prefetch_layer(b, a)); // reversed
    order(m.set_forward_prefetch_layer(c, a)); // a cycle through b
    order(m.forward_post(a, &s)); // no forward_pre
    m.forward_pre(a).unwrap();
    m.forward_post(a, &s).unwrap();
    order(m.save(Saved::Other(Arc::new(0u8))).map(drop)); // outside a forward
    order(m.backward_post(b)); // its backward never began
    m.backward_pre(b, &s).unwrap();
    order(m.backward_post(a)); // another layer's
    m.backward_post(b).unwrap();
    // end_iteration mid-backward is a defined recovery: every layer starts over in forward.
    m.backward_pre(a, &s).unwrap();
    m.end_iteration().unwrap();
    m.forward_pre(a).unwrap();
    assert!(m.is_recording(a));
}

#[test]
fn a_reference_from_an_ended_iteration_is_refused_not_misread() {
    let (p, s) = cpu(1 << 20);
    let mut m = SwapManager::new(Arc::clone(&p)).unwrap();
    let a = m.new_layer();
    m.forward_pre(a).unwrap();
    let (_, v) = tensor(&p, &s, 64, 1);
    let old = m.save(v).unwrap();
    m.forward_post(a, &s).unwrap();
    m.end_iteration().unwrap();
    m.forward_pre(a).unwrap();
    let (_, v) = tensor(&p, &s, 64, 2);
    m.save(v).unwrap(); // same layer and index as `old`
    assert!(matches!(m.get(old), Err(SwapError::Unknown { .. })));
    assert!(matches!(m.take(old), Err(SwapError::Unknown { .. })));
}

#[test]
fn hyper_parallel_group_calls_by_name() {
    let (p, s) = cpu(1 << 20);
    let mut m = SwapManager::new(Arc::clone(&p)).unwrap();
    m.set_current_group_name("layer0.attn");
    assert_eq!(m.get_current_group_name(), Some("layer0.attn"));
    let (buf, v) = tensor(&p, &s, 1024, 6);
    let r = m.add_storage("layer0.attn", v).unwrap();
    assert!(m.launch_offload("nope", &s).is_err());
    m.launch_offload("layer0.attn", &s).unwrap();
    m.wait_offload("layer0.attn").unwrap();
    assert_eq!(buf.len(), 0);
    m.launch_load("layer0.attn").unwrap();
    m.wait_load("layer0.attn", &s).unwrap();
    let back = m.take(r).unwrap();
    assert_eq!(bytes_of(&p, &s, &back), vec![6; 1024]);
    assert!(m.take(r).is_err(), "taken twice");
}

// --- keyed (saved_tensors_hooks swap) -----------------------------------------------------

#[test]
fn key_manager_new_layer_same_layer_and_restart() {
    let mut k = TensorKeyManager::new();
    assert_eq!(k.get_key(0), (TensorKey::new(0, 0), false));
    assert_eq!(k.get_key(0), (TensorKey::new(0, 1), false));
    assert_eq!(k.get_key(1), (TensorKey::new(1, 0), true));
    assert_eq!(k.get_key(1), (TensorKey::new(1, 1), false));
    assert_eq!(k.get_key(1), (TensorKey::new(1, 2), false));
    assert_eq!(k.get_prefetch_keys(TensorKey::new(1, 0)), vec![]);
    assert_eq!(
        k.get_prefetch_keys(TensorKey::new(1, 1)),
        vec![TensorKey::new(0, 0)]
    );
    assert_eq!(
        k.get_prefetch_keys(TensorKey::new(1, 2)),
        vec![TensorKey::new(0, 1)]
    );
    assert_eq!(k.get_prefetch_keys(TensorKey::new(0, 0)), vec![]);
    // A lower layer index starts a new step.
    assert_eq!(k.get_key(0), (TensorKey::new(0, 0), false));
    assert_eq!((k.count(0), k.count(1)), (1, 0));
}

proptest! {
    #[test]
    fn proportional_prefetch_covers_the_previous_layer_exactly_once(cur in 1usize..64, prev in 0usize..64) {
        let mut covered = Vec::new();
        for i in 0..cur {
            let r = proportional_slice(i, cur, prev);
            prop_assert!(r.start <= r.end);
            covered.extend(r);
        }
        prop_assert_eq!(covered, (0..prev).collect::<Vec<_>>());
    }

    #[test]
    fn key_manager_counts_match_saves(counts in proptest::collection::vec(1usize..6, 1..6)) {
        let mut k = TensorKeyManager::new();
        for (layer, n) in counts.iter().enumerate() {
            for i in 0..*n {
                let (key, new_layer) = k.get_key(layer);
                prop_assert_eq!(key, TensorKey::new(layer, i));
                prop_assert_eq!(new_layer, i == 0 && layer > 0);
            }
        }
        for layer in 1..counts.len() {
            let all: Vec<_> = (0..counts[layer]).flat_map(|i| k.get_prefetch_keys(TensorKey::new(layer, i))).collect();
            prop_assert_eq!(all, (0..counts[layer - 1]).map(|i| TensorKey::new(layer - 1, i)).collect::<Vec<_>>());
        }
    }
}

#[test]
fn module_tags_match_with_wildcards_and_count_layers_per_tag() {
    let tag = ModuleTag::new("model.layer.*.mlp.experts.0.up_proj");
    assert!(tag.matches("model.layer.2.mlp.experts.0.up_proj"));
    assert!(!tag.matches("model.layer.2.mlp.experts.1.up_proj"));
    assert!(!tag.matches("model.layer.2.mlp"));
    let (p, _) = cpu(1 << 20);
    let mut k = KeyedSwap::new(p).unwrap();
    k.add_tag("model.layer.*");
    k.add_tag("model.layer.*.mlp.experts.1.up_proj");
    let l0 = k.register_module("model.layer.0").unwrap();
    let e0 = k
        .register_module("model.layer.3.mlp.experts.1.up_proj")
        .unwrap();
    let l1 = k.register_module("model.layer.1").unwrap();
    assert_eq!((l0.layer, l1.layer, e0.layer), (0, 1, 0));
    assert_eq!((k.layer_count(&l0), k.layer_count(&e0)), (2, 1));
    assert!(matches!(
        k.register_module("decoder.block.0"),
        Err(SwapError::Unknown { .. })
    ));
}

#[test]
fn keyed_eligibility_parameters_empty_small_and_predicate() {
    let (p, s) = cpu(1 << 20);
    let mut k = KeyedSwap::new(Arc::clone(&p)).unwrap();
    let ctx = [k.register_layer("l"), k.register_layer("l")];
    k.set_min_bytes(100);
    k.set_predicate(Some(Box::new(|t: &DeviceTensor| t.dtype == DType::U8)));
    let (_, small) = tensor(&p, &s, 64, 1);
    let (_, mut param) = tensor(&p, &s, 256, 1);
    if let Saved::Tensor(t) = &mut param {
        t.is_parameter = true;
    }
    let empty = Saved::Tensor(DeviceTensor::whole(
        p.alloc_device(0).unwrap(),
        DType::U8,
        vec![0],
    ));
    let f32 = Saved::Tensor(DeviceTensor::whole(
        p.alloc_device(256).unwrap(),
        DType::F32,
        vec![64],
    ));
    for v in [small, param, empty, f32, Saved::Other(Arc::new(()))] {
        assert!(matches!(k.pack(&ctx[0], v, &s).unwrap(), Packed::Kept(_)));
    }
    let (buf, ok) = tensor(&p, &s, 256, 2);
    assert!(matches!(
        k.pack(&ctx[0], ok, &s).unwrap(),
        Packed::Swapped(key) if key == TensorKey::new(0, 0)
    ));
    assert_eq!(buf.len(), 256, "released only when the next layer saves");
    let (_, next) = tensor(&p, &s, 256, 3);
    let last = k.pack(&ctx[1], next, &s).unwrap();
    assert_eq!(buf.len(), 0, "the previous layer was released");
    assert_eq!(
        k.engine().stats().offloaded_tensors,
        1,
        "the last layer is not offloaded"
    );
    let back = k.unpack(last, &s).unwrap();
    assert_eq!(bytes_of(&p, &s, &back), vec![3; 256]);
    // Its unpack prefetched layer 0's tensor.
    assert_eq!(k.engine().stats().reloaded_tensors, 1);
    let back = k.unpack(Packed::Swapped(TensorKey::new(0, 0)), &s).unwrap();
    assert_eq!(bytes_of(&p, &s, &back), vec![2; 256]);
    assert!(matches!(
        k.unpack(Packed::Swapped(TensorKey::new(0, 0)), &s),
        Err(SwapError::Unknown { .. })
    ));
}

#[test]
fn keyed_layer_never_released_is_taken_back_without_a_copy() {
    let (p, s) = cpu(1 << 20);
    let mut k = KeyedSwap::new(Arc::clone(&p)).unwrap();
    let ctx = [k.register_layer("l"), k.register_layer("l")];
    let (buf, v) = tensor(&p, &s, 128, 6);
    let packed = k.pack(&ctx[0], v, &s).unwrap();
    // Layer 1 saves nothing eligible: layer 0 is still in flight at backward.
    let back = k.unpack(packed, &s).unwrap();
    assert_eq!(bytes_of(&p, &s, &back), vec![6; 128]);
    assert_eq!(buf.len(), 128);
    assert_eq!(k.engine().stats().reloaded_tensors, 0);
}

// --- chunked pipeline (Megatron-LM) -------------------------------------------------------

fn pipeline(p: &Arc<dyn Platform>, min_elems: usize) -> PipelineOffload {
    let cfg = PipelineConfig {
        min_tensor_elems: min_elems,
        ..PipelineConfig::default()
    };
    PipelineOffload::new(Arc::clone(p), cfg).unwrap()
}

#[test]
fn default_min_size_is_one_mebi_elements() {
    let (p, s) = cpu(64 << 20);
    let mut o = PipelineOffload::new(Arc::clone(&p), PipelineConfig::default()).unwrap();
    o.init_chunk(1, None).unwrap();
    o.group_start("g").unwrap();
    let (_, small) = tensor(&p, &s, (1 << 20) - 1, 1);
    let (_, big) = tensor(&p, &s, 1 << 20, 1);
    assert!(matches!(o.save(small).unwrap(), OffloadTag::Kept(_)));
    assert!(matches!(o.save(big).unwrap(), OffloadTag::Offloaded { .. }));
}

#[test]
fn disable_mark_not_offloadable_and_chunk_marks_keep_tensors() {
    let (p, s) = cpu(1 << 20);
    let mut o = pipeline(&p, 1);
    o.init_chunk(1, None).unwrap();
    o.group_start("g").unwrap();
    o.disable();
    let (_, a) = tensor(&p, &s, 64, 1);
    assert!(matches!(o.save(a).unwrap(), OffloadTag::Kept(_)));
    o.enable();
    let (_, b) = tensor(&p, &s, 64, 1);
    o.mark_not_offloadable(b.tensor().unwrap());
    assert!(matches!(o.save(b).unwrap(), OffloadTag::Kept(_)));
    let (_, c) = tensor(&p, &s, 64, 1);
    assert!(matches!(o.save(c).unwrap(), OffloadTag::Offloaded { .. }));
    o.mark_chunk_not_offloadable().unwrap();
    let (_, d) = tensor(&p, &s, 64, 1);
    assert!(matches!(o.save(d).unwrap(), OffloadTag::Kept(_)));
    assert!(matches!(o.group_start("h"), Err(SwapError::Order(_))));
}

/// Runs `groups` groups of one 4 KiB tensor each through one chunk; returns the device
/// buffers and tags.
fn forward_chunk(
    o: &mut PipelineOffload,
    p: &Arc<dyn Platform>,
    s: &Stream,
    vp: (usize, usize),
    groups: usize,
    fill: u8,
) -> Vec<(DeviceBuffer, OffloadTag)> {
    o.init_chunk(vp.0, Some(vp.1)).unwrap();
    (0..groups)
        .map(|g| {
            o.group_start(&format!("g{g}")).unwrap();
            let (buf, v) = tensor(p, s, 4096, fill + g as u8);
            let tag = o.save(v).unwrap();
            o.group_commit(s, Vec::new(), false).unwrap();
            (buf, tag)
        })
        .collect()
}

fn backward_chunk(
    o: &mut PipelineOffload,
    p: &Arc<dyn Platform>,
    s: &Stream,
    saved: &[(DeviceBuffer, OffloadTag)],
    fill: u8,
) {
    for (g, (_, tag)) in saved.iter().enumerate().rev() {
        o.backward_group_begin(&format!("g{g}"), s).unwrap();
        assert_eq!(
            bytes_of(p, s, &o.get(tag, s).unwrap()),
            vec![fill + g as u8; 4096]
        );
        o.backward_group_end().unwrap();
    }
}

#[test]
fn virtual_pipeline_chunks_run_backward_last_stage_first() {
    let (p, s) = cpu(1 << 20);
    let mut o = pipeline(&p, 1);
    let mb0s0 = forward_chunk(&mut o, &p, &s, (2, 0), 3, 10);
    let mb0s1 = forward_chunk(&mut o, &p, &s, (2, 1), 3, 20);
    let mb1s0 = forward_chunk(&mut o, &p, &s, (2, 0), 3, 30);
    let mb1s1 = forward_chunk(&mut o, &p, &s, (2, 1), 3, 40);
    // Backward must visit mb0 stage 1, mb0 stage 0, mb1 stage 1, mb1 stage 0.
    assert!(matches!(
        o.backward_group_begin("g0", &s),
        Err(SwapError::Order(_))
    ));
    backward_chunk(&mut o, &p, &s, &mb0s1, 20);
    backward_chunk(&mut o, &p, &s, &mb0s0, 10);
    backward_chunk(&mut o, &p, &s, &mb1s1, 40);
    backward_chunk(&mut o, &p, &s, &mb1s0, 30);
    assert!(matches!(
        o.backward_group_begin("g0", &s),
        Err(SwapError::Order(_))
    ));
    assert!(o.init_chunk(2, Some(2)).is_err());
}

#[test]
fn inflight_cap_releases_older_groups_and_forced_release_frees_extra_buffers() {
    let (p, s) = cpu(1 << 20);
    let mut o = pipeline(&p, 1);
    o.init_chunk(1, None).unwrap();
    let mut bufs = Vec::new();
    for g in 0..3 {
        o.group_start(&format!("g{g}")).unwrap();
        let (buf, v) = tensor(&p, &s, 4096, g);
        o.save(v).unwrap();
        let extra = p.alloc_device(1000).unwrap();
        o.group_commit(&s, vec![extra.clone()], false).unwrap();
        bufs.push((buf, extra));
    }
    // Cap 1: committing g2 released g0 and g1 (device bytes and forced buffers).
    for (buf, extra) in &bufs[..2] {
        assert_eq!((buf.len(), extra.len()), (0, 0));
    }
}

#[test]
fn forced_release_of_borrowed_memory_frees_it_once_the_offload_completed() {
    let (p, s) = cpu(1 << 20);
    let mut o = pipeline(&p, 1);
    o.init_chunk(1, None).unwrap();
    let owner = p.alloc_device(1000).unwrap();
    let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = Arc::clone(&released);
    let release: hprt_platform::ReleaseFn =
        Box::new(move || flag.store(true, std::sync::atomic::Ordering::SeqCst));
    // SAFETY: `owner` outlives the borrow (it is dropped at the end of the test).
    let borrowed =
        unsafe { p.wrap_device_memory(owner.device_ptr(), 1000, Some(release)) }.unwrap();
    for g in 0..2 {
        o.group_start(&format!("g{g}")).unwrap();
        let (_, v) = tensor(&p, &s, 4096, g);
        o.save(v).unwrap();
        let forced = if g == 0 {
            vec![borrowed.clone()]
        } else {
            Vec::new()
        };
        o.group_commit(&s, forced, false).unwrap();
    }
    drop(borrowed);
    // Committing g1 finished g0's offload: hprt let go of the borrowed memory.
    assert!(released.load(std::sync::atomic::Ordering::SeqCst));
}

#[test]
fn the_last_layer_stays_on_the_device_when_its_backward_comes_next() {
    let (p, s) = cpu(1 << 20);
    let mut o = pipeline(&p, 4);
    o.init_chunk(1, None).unwrap();
    let mut saved = Vec::new();
    for g in 0..3u8 {
        o.set_last_layer(g == 2).unwrap();
        o.group_start(&format!("g{g}")).unwrap();
        let (buf, v) = tensor(&p, &s, 4096, g);
        saved.push((buf, o.save(v).unwrap()));
        o.group_commit(&s, Vec::new(), false).unwrap();
    }
    assert_eq!(
        o.engine().stats().offloaded_tensors,
        2,
        "the last layer's group stays"
    );
    // A chunk whose backward is not next (an earlier chunk waits for its backward) offloads it.
    o.init_chunk(1, None).unwrap();
    o.set_last_layer(true).unwrap();
    o.group_start("g0").unwrap();
    let (_, v) = tensor(&p, &s, 4096, 9);
    o.save(v).unwrap();
    o.group_commit(&s, Vec::new(), false).unwrap();
    assert_eq!(o.engine().stats().offloaded_tensors, 3);
    for (g, (_, tag)) in saved.iter().enumerate().rev() {
        o.backward_group_begin(&format!("g{g}"), &s).unwrap();
        assert_eq!(
            bytes_of(&p, &s, &o.get(tag, &s).unwrap()),
            vec![g as u8; 4096]
        );
        o.backward_group_end().unwrap();
    }
}

#[test]
fn delayed_groups_offload_at_flush() {
    let (p, s) = cpu(1 << 20);
    let mut o = pipeline(&p, 1);
    o.init_chunk(1, None).unwrap();
    o.group_start("g0").unwrap();
    let (_, v) = tensor(&p, &s, 4096, 1);
    let tag = o.save(v).unwrap();
    o.group_commit(&s, Vec::new(), true).unwrap();
    assert_eq!(o.engine().stats().offloaded_tensors, 0);
    o.flush_delayed_groups(&s).unwrap();
    assert_eq!(o.engine().stats().offloaded_tensors, 1);
    o.record_forward(&s).unwrap();
    o.join_offloads(&s).unwrap();
    o.backward_group_begin("g0", &s).unwrap();
    o.record_backward(&s).unwrap();
    assert_eq!(bytes_of(&p, &s, &o.get(&tag, &s).unwrap()), vec![1; 4096]);
}

#[test]
fn warmup_enables_keep_last_margin_and_the_summary() {
    let (p, s) = cpu(1 << 20);
    let mut o = pipeline(&p, 1);
    let saved = forward_chunk(&mut o, &p, &s, (1, 0), 3, 1);
    backward_chunk(&mut o, &p, &s, &saved, 1);
    assert_eq!(
        o.engine().stats().offloaded_tensors,
        3,
        "warm-up offloads every group"
    );
    o.post_warmup();
    o.reset().unwrap();
    assert!(
        o.offload_summary_bytes().is_empty(),
        "the warm-up iteration is not summarized"
    );
    let saved = forward_chunk(&mut o, &p, &s, (1, 0), 3, 1);
    assert_eq!(
        o.engine().stats().offloaded_tensors,
        5,
        "the last group stays on the device"
    );
    assert_eq!(saved[2].0.len(), 4096);
    backward_chunk(&mut o, &p, &s, &saved, 1);
    o.reset().unwrap();
    let expected = BTreeMap::from([("g0".to_string(), 4096u64), ("g1".to_string(), 4096)]);
    assert_eq!(o.offload_summary_bytes(), &expected);
    assert_eq!(o.offload_summary_total_bytes(), 8192);
    let table = offload_summary_table(&[expected.clone(), BTreeMap::from([("g0".to_string(), 7)])]);
    assert_eq!(
        table,
        "| rank | g0 | g1 | total |\n|---:|---:|---:|---:|\n| 0 | 4096 | 4096 | 8192 |\n| 1 | 7 | 0 | 7 |\n"
    );
}

#[test]
fn take_hands_a_reloaded_tensor_over_and_the_tag_is_spent() {
    // hprt.torch reads values one by one and ends no groups: with `get` alone the offload held
    // every reloaded tensor of a pass until the reset (on an H100, pipeline mode's peak was
    // above plain torch's).
    let (p, s) = cpu(1 << 20);
    let mut o = pipeline(&p, 1);
    o.init_chunk(1, None).unwrap();
    let mut tags = Vec::new();
    for (g, fill) in [("g0", 3u8), ("g1", 4)] {
        o.group_start(g).unwrap();
        let (_, v) = tensor(&p, &s, 4096, fill);
        tags.push(o.save(v).unwrap());
        o.group_commit(&s, Vec::new(), false).unwrap();
    }
    o.join_offloads(&s).unwrap();
    p.synchronize_device().unwrap();
    let before = p.memory_stats().device_current;
    let back = o.take(&tags[0], &s).unwrap();
    assert_eq!(bytes_of(&p, &s, &back), vec![3; 4096]);
    assert!(p.memory_stats().device_current > before, "reloaded");
    drop(back);
    p.synchronize_device().unwrap();
    assert_eq!(
        p.memory_stats().device_current,
        before,
        "the caller's reference was the last"
    );
    for again in [o.take(&tags[0], &s), o.get(&tags[0], &s)] {
        assert!(
            matches!(&again, Err(SwapError::Order(m)) if m.contains("already taken")),
            "{:?}",
            again.map(|_| ())
        );
    }
}
