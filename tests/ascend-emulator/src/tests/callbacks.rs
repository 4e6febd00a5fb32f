//! Host callbacks, blocking and non-blocking.

use super::*;

struct CbState {
    log: Mutex<Vec<&'static str>>,
    release: Mutex<Option<mpsc::Receiver<()>>>,
}

unsafe extern "C" fn slow_cb(user: *mut c_void) {
    // SAFETY: `user` is `Arc::as_ptr` of the test's `CbState`, which outlives every callback
    // launched with it (each ran, or failed its stream, before the test returns).
    let st = unsafe { &*(user as *const CbState) };
    std::thread::sleep(Duration::from_millis(30));
    st.log.lock().unwrap().push("callback");
}

unsafe extern "C" fn gated_cb(user: *mut c_void) {
    // SAFETY: `user` is `Arc::as_ptr` of the test's `CbState`, which outlives every callback
    // launched with it (each ran, or failed its stream, before the test returns).
    let st = unsafe { &*(user as *const CbState) };
    if let Some(rx) = st.release.lock().unwrap().take() {
        let _ = rx.recv();
    }
    st.log.lock().unwrap().push("gated");
}

extern "C" {
    fn pthread_self() -> usize;
}

#[test]
fn callbacks_block_and_no_block() {
    let _g = setup();
    static STOP: AtomicBool = AtomicBool::new(false);
    STOP.store(false, Ordering::SeqCst);
    let state = Arc::new(CbState {
        log: Mutex::new(Vec::new()),
        release: Mutex::new(None),
    });
    let user = Arc::as_ptr(&state) as *mut c_void;
    let user_addr = user as usize;
    // SAFETY: `user` points at `state`, alive to the end of the test, after every callback launched
    // with it ran or was dropped with its failed stream; both callbacks have the header's
    // signature; `pthread_self` has no preconditions; stream handles are registry-checked (module
    // doc).
    unsafe {
        let inv = ACL_ERROR_INVALID_PARAM;
        let s = new_stream();
        assert_eq!(
            aclrtLaunchCallback(Some(slow_cb), user, 1, s),
            inv,
            "not subscribed"
        );
        assert_eq!(aclrtProcessReport(10), ACL_ERROR_RT_REPORT_TIMEOUT);
        assert_eq!(aclrtProcessReport(-2), inv);

        std::thread::scope(|scope| {
            let (tid_tx, tid_rx) = mpsc::channel();
            scope.spawn(move || {
                assert_eq!(aclrtSetDevice(0), 0);
                tid_tx.send(pthread_self() as u64).unwrap();
                while !STOP.load(Ordering::SeqCst) {
                    let rc = aclrtProcessReport(5);
                    assert!(rc == 0 || rc == ACL_ERROR_RT_REPORT_TIMEOUT, "{rc}");
                }
            });
            let tid = tid_rx.recv().unwrap();
            assert_eq!(aclrtSubscribeReport(tid, s), 0);
            assert_eq!(aclrtSubscribeReport(tid, s), inv, "already subscribed");
            assert_eq!(aclrtLaunchCallback(None, user, 1, s), inv);
            assert_eq!(aclrtLaunchCallback(Some(slow_cb), user, 2, s), inv);

            // BLOCK: work after the callback waits for it.
            assert_eq!(
                aclrtLaunchCallback(Some(slow_cb), user, ACL_CALLBACK_BLOCK, s),
                0
            );
            let st = state.clone();
            stream::resolve(s).unwrap().enqueue(Box::new(move || {
                st.log.lock().unwrap().push("after");
                Ok(())
            }));
            assert_eq!(sync(s), 0);
            assert_eq!(*state.log.lock().unwrap(), ["callback", "after"]);

            // NO_BLOCK: the stream runs on while the callback is still pending.
            let (rel_tx, rel_rx) = mpsc::channel();
            *state.release.lock().unwrap() = Some(rel_rx);
            let u = user_addr as *mut c_void;
            assert_eq!(
                aclrtLaunchCallback(Some(gated_cb), u, ACL_CALLBACK_NO_BLOCK, s),
                0
            );
            assert_eq!(sync(s), 0);
            assert_eq!(state.log.lock().unwrap().len(), 2);
            rel_tx.send(()).unwrap();
            let t0 = Instant::now();
            while state.log.lock().unwrap().len() < 3 {
                assert!(t0.elapsed() < Duration::from_secs(5));
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(aclrtUnSubscribeReport(tid + 1, s), inv);
            assert_eq!(aclrtUnSubscribeReport(tid, s), 0);
            assert_eq!(aclrtUnSubscribeReport(tid, s), inv);
            STOP.store(true, Ordering::SeqCst);
        });

        // A blocking callback nobody will run fails the stream when its binding goes away.
        assert_eq!(aclrtSubscribeReport(0xDEAD, s), 0);
        assert_eq!(
            aclrtLaunchCallback(Some(slow_cb), user, ACL_CALLBACK_BLOCK, s),
            0
        );
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(aclrtUnSubscribeReport(0xDEAD, s), 0);
        assert_eq!(sync(s), ACL_ERROR_RT_INTERNAL_ERROR);
        destroy_stream(s);
    }
}
